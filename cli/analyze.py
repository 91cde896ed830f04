"""``align`` and ``curvature``: check PLATE's assumptions on a small model before training."""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from plate_inspect.cli.common import console, err_console, progress_bar, quiet_option, split_names
from plate_inspect.errors import ConfigError, cli_text, json_file_holds, refuse_to_replace

if TYPE_CHECKING:
    from torch import nn

    from plate_inspect.analysis.alignment import AlignmentRecord
    from plate_inspect.analysis.curvature import CurvatureRecord, UpdateFamily
    from plate_inspect.bundle import Bundle


def _int_list(value: str, what: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{what}: expected comma-separated integers, got '{value}'") from None
    if not out or any(v < 1 for v in out):
        raise ConfigError(f"{what}: expected positive integers, got '{value}'")
    return out


def _float_list(value: str, what: str) -> list[float]:
    try:
        out = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{what}: expected comma-separated numbers, got '{value}'") from None
    if not out:
        raise ConfigError(f"{what}: expected at least one number")
    if not all(math.isfinite(v) for v in out):
        raise ConfigError(f"{what}: expected finite numbers, got '{value}'")
    return out


def _records_of(key: str) -> Callable[[Any], bool]:
    """Whether a JSON value is a list of this command's records (each an object with ``key``): an earlier
    --json-out, which a rerun may replace."""
    return lambda value: isinstance(value, list) and all(isinstance(r, dict) and key in r for r in value)


def _check_json_out(path: Path | None, key: str) -> None:
    """Refuse an unusable --json-out before the long work (a directory, a device, a parent that cannot be made, an
    existing file that is not this command's records: a model's weights, a bundle's manifest). ``key``: a field
    every record of the command has."""
    from plate_inspect.atomic import make_dirs, os_error_reason, refuse_special_file

    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; give a file name, e.g. --json-out {path / 'records.json'}")
    refuse_to_replace(
        path,
        lambda p: json_file_holds(p, _records_of(key)),
        f"a JSON list of {key} records",
        "the records",
        "--json-out",
        "records.json",
    )
    try:
        refuse_special_file(path)
    except OSError as e:
        raise ConfigError(
            f"{path}: not a regular file ({os_error_reason(path, e)}); choose another --json-out"
        ) from None
    make_dirs(path.parent, "the directory of --json-out", "--json-out")


def _write_json_out(path: Path | None, records: list) -> None:
    """The records' JSON written atomically (a run that fails or is interrupted leaves no partial file)."""
    from plate_inspect.atomic import atomic_write, os_error_reason

    if path is None:
        return
    try:
        atomic_write(path, json.dumps(records, indent=2) + "\n")
    except OSError as e:
        raise ConfigError(
            f"{path}: cannot write the records ({os_error_reason(path, e)}); choose another --json-out"
        ) from None
    err_console.print(f"wrote {path}", soft_wrap=True, markup=False)


JSON_OUT_HELP = "Also write the records as JSON to this file, atomically (after the run; checked before it)."
#: Counts above these are typos (10^30 ran for ever, or died in numpy after the training): (flag, cap, default).
MAX_EPOCHS = ("--epochs", 10_000, 30)
MAX_PROBES = ("--probes", 100_000, 100)
MAX_RANDOM_DRAWS = ("--random-draws", 10_000, 8)


def _check_count(value: int, cap: tuple[str, int, int]) -> None:
    """ConfigError for a count above its cap, naming the flag, the cap and the default."""
    flag, most, default = cap
    if value > most:
        raise ConfigError(
            f"{flag} {value:,} is more than {most:,} (~{most // default:,}x the default {default}); "
            f"give a count such as {default}"
        )


def _check_seed(seed: int) -> None:
    """A seed torch and numpy both take: 0 <= seed < 2^63 (10^30 was an OverflowError traceback)."""
    from plate_inspect.arguments import MAX_SEED

    if seed < 0:  # numpy's generators (Lanczos start, probes) refuse negative seeds
        raise ConfigError(f"--seed must be a non-negative integer, got {seed}")
    if seed > MAX_SEED:
        raise ConfigError(f"--seed {seed:,} is more than 2^63 - 1 (torch's largest seed); give a seed such as 0")


def _family(name: str, model: nn.Module, bundle: Bundle, lora_rank: int, seed: int) -> UpdateFamily:
    """The update family ``name`` (full_backbone, lora or a PLATE variant) on the digits MLP's backbone."""
    from plate_inspect.analysis.curvature import full_family, lora_family, plate_family

    backbone = ["fc1", "fc2", "fc3"]
    if name == "full_backbone":
        return full_family(model, [f"{m}.{p}" for m in backbone for p in ("weight", "bias")], name="full_backbone")
    if name == "lora":
        return lora_family(model, backbone, lora_rank, seed=seed)
    return plate_family(model, bundle, variant=name, seed=seed, modules=backbone)


# --------------------------------------------------------------------------- align
@click.command("align")
@click.argument("model", required=False)
@click.option(
    "--text",
    "text_file",
    type=click.Path(path_type=Path),
    default=None,
    help="UTF-8 English text to run through the model [default: scikit-learn's bundled dataset descriptions].",
)
@click.option("--k", "ks", default="8,32", show_default=True, help="Comma-separated subspace dimensions k.")
@click.option("--max-tokens", type=int, default=20000, show_default=True, help="Use at most this many text tokens.")
@click.option(
    "--seq-len",
    type=int,
    default=256,
    show_default=True,
    help="Tokens per forward window (at most the model's max_position_embeddings; a note says when capped).",
)
@click.option("--target-modules", default=None, help="Comma-separated module names or regexes [default: family's].")
@click.option("--random-draws", type=int, default=8, show_default=True, help="Random k-frames averaged per k.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random k-frames (>= 0).")
@click.option("--per-layer", is_flag=True, help="One table row per layer (default: averaged per module type).")
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON on stdout.")
@click.option("--json-out", type=click.Path(path_type=Path), default=None, help=JSON_OUT_HELP)
@quiet_option()
def align_command(
    model: str | None,
    text_file: Path | None,
    ks: str,
    max_tokens: int | None,
    seq_len: int,
    target_modules: str | None,
    random_draws: int,
    seed: int,
    per_layer: bool,
    as_json: bool,
    json_out: Path | None,
    quiet: bool,
) -> None:
    """Weight geometry vs. activation geometry of every target linear layer of MODEL.

    MODEL is a local Hugging Face model directory with a tokenizer (needs transformers); without MODEL the
    embedded all-MiniLM-L6-v2 is used. Each layer's input activations X are streamed through hooks (only
    X^T X is kept). For each k it reports the activation variance captured by the top-k right singular
    vectors of W (VE weight), by the top-k eigenvectors of X^T X / N (oracle) and by random k-frames, their
    ratio VE(W)/VE(random), and AL_k = ||U_k^T V_k||_F^2 / k against its chance level k / d_in.

    \b
    Examples:
      plate-inspect align                                   # embedded MiniLM on scikit-learn's docs text
      plate-inspect align ./my-bert --text corpus.txt --k 8,32 --max-tokens 50000
      plate-inspect align ./my-bert --text corpus.txt --json-out alignment.json
    """
    from plate_inspect.analysis.alignment import SKLEARN_TEXT_SOURCE, hf_text_alignment, read_text, sklearn_descr_text
    from plate_inspect.targets import check_target_patterns

    k_values = _int_list(ks, "--k")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens must be positive, got {max_tokens}")
    if seq_len < 2:
        raise ConfigError(f"--seq-len must be at least 2, got {seq_len}")
    if random_draws < 1:
        raise ConfigError(f"--random-draws must be positive, got {random_draws}")
    _check_count(random_draws, MAX_RANDOM_DRAWS)
    _check_seed(seed)
    targets = split_names(target_modules)
    check_target_patterns(targets)
    _check_json_out(json_out, "module")
    if model is None:
        from plate_inspect.embedded import DEFAULT_MODEL_NAME, default_model_path

        model = str(default_model_path())
        err_console.print(f"no model given: using {DEFAULT_MODEL_NAME}")
    if text_file is None:
        text = sklearn_descr_text()
        err_console.print(f"no --text given: using {SKLEARN_TEXT_SOURCE}")
    else:
        text = read_text(text_file)
    with progress_bar("align", quiet=quiet or as_json) as progress:
        records = hf_text_alignment(
            model,
            text,
            ks=k_values,
            max_tokens=max_tokens,
            seq_len=seq_len,
            target_modules=targets,
            n_random=random_draws,
            seed=seed,
            progress=progress,
            notes=lambda text: err_console.print(f"note: {cli_text(text)}", soft_wrap=True, markup=False),
        )
    _write_json_out(json_out, [r.to_json() for r in records])
    if as_json:
        click.echo(json.dumps([r.to_json() for r in records], indent=2))
        return
    print_alignment_table(records, per_layer=per_layer)


def print_alignment_table(records: list[AlignmentRecord], per_layer: bool = False) -> None:
    """Rows per module type (mean over layers) or per layer, one column group per k."""
    from collections import defaultdict

    from plate_inspect.targets import module_type_of

    groups: dict[tuple[str, int], list] = defaultdict(list)
    for r in records:
        groups[(r.module if per_layer else module_type_of(r.module), r.k)].append(r)
    n_tokens = max((r.n_samples for r in records), default=0)
    table = Table(title=f"weight vs. activation geometry ({n_tokens:,} token rows per layer)")
    for col in ("module" if per_layer else "module type", "layers", "d_in", "k"):
        table.add_column(col, justify="left" if col.startswith("module") else "right", no_wrap=True)
    for col in ("VE(W)", "VE oracle", "VE rand", "VE(W)/VE(rand)", "AL_k", "k/d_in", "AL/chance"):
        table.add_column(col, justify="right", no_wrap=True)
    for (name, k), rs in groups.items():
        mean = lambda attr, rs=rs: sum(getattr(r, attr) for r in rs) / len(rs)  # noqa: E731
        table.add_row(
            name,
            str(len(rs)),
            str(rs[0].d_in),
            str(k),
            f"{mean('ve_weight'):.4f}",
            f"{mean('ve_oracle'):.4f}",
            f"{mean('ve_random'):.4f}",
            f"{mean('ve_ratio'):.2f}x",
            f"{mean('al_weight'):.3f}",
            f"{rs[0].al_chance:.4f}",
            f"{mean('al_over_chance'):.1f}x",
        )
    console.print(table)


# --------------------------------------------------------------------------- curvature
@click.command("curvature")
@click.option("--out", "-o", type=click.Path(path_type=Path), default=None, help="Keep the checkpoint and bundle here.")
@click.option("--epochs", type=int, default=30, show_default=True, help="Stage-1 training epochs on task 1.")
@click.option("--r", "r", type=int, default=8, show_default=True, help="PLATE output rows per module.")
@click.option("--tau", type=float, default=0.98, show_default=True, help="PLATE energy threshold.")
@click.option("--max-rank", type=int, default=256, show_default=True, help="Cap on PLATE's k.")
@click.option("--lora-rank", type=int, default=8, show_default=True, help="Rank of the LoRA tangent family.")
@click.option("--probes", type=int, default=100, show_default=True, help="Random unit directions per family.")
@click.option("--rho", "rhos", default="0,0.1,0.25,0.5,1,2", show_default=True, help="Steps for F(rho).")
@click.option(
    "--families",
    default="full_backbone,lora,plate,random_b,random_q,high_energy_q",
    show_default=True,
    help="Comma-separated families: full_backbone, lora, plate and its matched-capacity ablations random_b, "
    "random_q, high_energy_q, least_redundant_b, random_bq.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the training, the random families and probes (>= 0).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON on stdout.")
@click.option("--json-out", type=click.Path(path_type=Path), default=None, help=JSON_OUT_HELP)
@quiet_option()
def curvature_command(
    out: Path | None,
    epochs: int,
    r: int,
    tau: float,
    max_rank: int,
    lora_rank: int,
    probes: int,
    rhos: str,
    families: str,
    seed: int,
    as_json: bool,
    json_out: Path | None,
    quiet: bool,
) -> None:
    """Restricted curvature, drift radius and Gauss-Newton share per update family on the digits MLP.

    Trains the digits MLP on task 1 (digits 0-4 = P0), saves it as safetensors, scans fc1/fc2/fc3 into a
    PLATE bundle, then for each family S: lambda(S) (top eigenvalue of the Hessian restricted to S), eps(S)
    (worst unit-norm drift ||J v|| on P0), medians of |q_GN|/|q_H| and |q_R|/|q_GN| over random unit probes,
    the bound lambda(S) <= beta eps(S)^2, and the forgetting curve F(rho) along the top-curvature direction.
    Everything is matrix-free (Lanczos on operators of dimension dim(S)); CPU takes ~25 s on 2 quiet cores.

    \b
    Examples:
      plate-inspect curvature
      plate-inspect curvature --r 32 --tau 0.8 --lora-rank 16 --probes 300
      plate-inspect curvature --families plate,random_q --json-out curvature.json
    """
    import torch.nn.functional as F

    from plate_inspect.analysis.curvature import (
        PLATE_VARIANTS,
        analyze_families,
        batches,
        digits_stage1,
    )
    from plate_inspect.geometry import validate_settings

    rho_values = _float_list(rhos, "--rho")
    wanted = list(dict.fromkeys(f.strip() for f in families.split(",") if f.strip()))  # each family once
    known = ("full_backbone", "lora", *PLATE_VARIANTS)
    unknown = [f for f in wanted if f not in known]
    if unknown or not wanted:
        raise ConfigError(f"--families: unknown {unknown or 'empty list'}; choose from {', '.join(known)}")
    counts = (("--epochs", epochs), ("--lora-rank", lora_rank), ("--r", r), ("--max-rank", max_rank))
    for name, value in (*counts, ("--probes", probes)):  # --probes 0: medians over no probes are NaN
        if value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value}")
    _check_count(epochs, MAX_EPOCHS)  # all before the stage-1 training
    _check_count(probes, MAX_PROBES)
    _check_seed(seed)
    _check_digits_ranks(r, lora_rank)
    validate_settings(r=r, tau=tau, max_rank=max_rank)  # before the minute of stage-1 training
    _check_json_out(json_out, "family")

    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="plate-curvature-")
        out = Path(tmp.name)
    try:
        with progress_bar("stage 1: train on task 1", quiet=quiet or as_json) as progress:
            setup = digits_stage1(out, epochs=epochs, seed=seed, r=r, tau=tau, max_rank=max_rank, progress=progress)
        model, bundle = setup.model, setup.bundle
        fams = [_family(name, model, bundle, lora_rank, seed) for name in wanted]
        with progress_bar("curvature", quiet=quiet or as_json) as progress:
            records = analyze_families(
                model,
                F.cross_entropy,
                batches(setup.task1.x_train, setup.task1.y_train),
                fams,
                n_probes=probes,
                rhos=rho_values,
                seed=seed,
                progress=progress,
            )
    finally:
        if tmp is not None:
            tmp.cleanup()
    _write_json_out(json_out, [rec.to_json() for rec in records])
    if as_json:
        click.echo(json.dumps([rec.to_json() for rec in records], indent=2))
        return
    ks = {m: bundle.record(m).k for m in ("fc1", "fc2", "fc3")}
    console.print(
        f"digits MLP after task 1: test accuracy {setup.task1_test_accuracy:.4f}, "
        f"PLATE r={r} tau={tau} k={ks}, beta={records[0].beta:.4g}, {probes} probes per family"
    )
    print_curvature_table(records)


def _check_digits_ranks(r: int, lora_rank: int) -> None:
    """Ranks that fit the digits MLP's fc1/fc2/fc3, checked before the minute of stage-1 training."""
    from plate_inspect.experiments.digits import DigitsMLP

    layers = [getattr(DigitsMLP(), name) for name in ("fc1", "fc2", "fc3")]
    min_out = min(m.out_features for m in layers)
    min_side = min(min(m.out_features, m.in_features) for m in layers)
    if r > min_out:
        raise ConfigError(f"--r must be at most {min_out} (the output dimension of the digits MLP's layers), got {r}")
    if lora_rank > min_side:
        raise ConfigError(f"--lora-rank must be at most {min_side} (min(d_out, d_in) of fc1), got {lora_rank}")


def print_curvature_table(records: list[CurvatureRecord]) -> None:
    """One row per family: dim, lambda, lambda_GN, eps, the bound, GN medians and F at the largest rho."""
    table = Table(title="restricted curvature and drift on P0 (task 1)")
    rho_max = records[0].forgetting_curve[-1][0] if records and records[0].forgetting_curve else None
    cols = ["family", "dim", "lam(S)", "lam_GN(S)", "eps(S)", "b*eps^2", "lam/(b eps^2)"]
    cols += ["|qGN|/|qH|", "|qR|/|qGN|"] + ([f"F({rho_max:g})"] if rho_max is not None else [])
    for col in cols:
        table.add_column(col, justify="left" if col == "family" else "right", no_wrap=True)
    for rec in records:
        row = [
            rec.family,
            f"{rec.dim:,}",
            f"{rec.lam:.4g}",
            f"{rec.lam_gn:.4g}",
            f"{rec.eps:.4g}",
            f"{rec.bound:.4g}",
            f"{rec.bound_ratio:.3g}" + (" ok" if rec.bound_ratio <= 1 else " NO"),
            f"{rec.gn_share_median:.3g}",
            f"{rec.residual_ratio_median:.3g}",
        ]
        if rho_max is not None:
            row.append(f"{rec.forgetting_curve[-1][1]:.4g}")
        table.add_row(*row)
    table.caption = (
        "lam/(b eps^2) <= 1: the bound lambda(S) <= beta eps(S)^2 holds; |qGN|/|qH| and |qR|/|qGN|: medians over "
        "random unit probes; F(rho) = L0(theta0 + rho v*) - L0(theta0) along the top-curvature direction v*"
    )
    console.print(table)
    if records and records[0].forgetting_curve:
        curve = Table(title="forgetting curve F(rho) along each family's top-curvature direction")
        curve.add_column("family", no_wrap=True)
        for rho, _ in records[0].forgetting_curve:
            curve.add_column(f"rho={rho:g}", justify="right", no_wrap=True)
        for rec in records:
            curve.add_row(rec.family, *(f"{f:.3g}" for _, f in rec.forgetting_curve))
        console.print(curve)
        overflowed = sorted({rho for rec in records for rho, f in rec.forgetting_curve if not math.isfinite(f)})
        if overflowed:
            console.print(
                f"F is not finite at rho = {', '.join(f'{rho:g}' for rho in overflowed)}: a step that long overflows "
                "the model's float32 loss; give smaller --rho values"
            )
