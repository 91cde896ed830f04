"""``scan``, ``info`` and ``verify``: make a PLATE init bundle, summarise it, check it against weights."""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from plate_inspect.bundle import Bundle, ModuleRecord, ScanSettings, unfinished_note, unfinished_state
from plate_inspect.cli.common import console, err_console, human_bytes, progress_bar, quiet_option, split_names
from plate_inspect.distributed import rank_from_env
from plate_inspect.embedded import DEFAULT_MODEL_NAME, default_model_path
from plate_inspect.errors import PlateInspectError
from plate_inspect.formatting import counted
from plate_inspect.scanner import (
    check_devices,
    check_out_dir,
    default_out_dir,
    plan_scan,
    previous_source,
    run_scan,
    same_model,
    source_record,
)
from plate_inspect.targets import format_layers, parse_layers


def summary_rows(records: list[ModuleRecord]) -> list[dict]:
    """Per module type: count, mean k, mean captured energy, PLATE r*k vs LoRA r*(d_in+d_out) parameters."""
    groups: dict[str, list[ModuleRecord]] = defaultdict(list)
    for rec in records:
        groups[rec.module_type].append(rec)
    rows = []
    for module_type, recs in groups.items():
        rows.append(
            {
                "module_type": module_type,
                "count": len(recs),
                "shape": recs[0].shape,
                "mean_k": sum(r.k for r in recs) / len(recs),
                "mean_captured_energy": sum(r.captured_energy for r in recs) / len(recs),
                "plate_params": sum(r.trainable_params for r in recs),
                "lora_params": sum(r.lora_params for r in recs),
            }
        )
    return rows


def print_summary(bundle: Bundle) -> None:
    """Print a bundle's state, source, settings and targets, then its per-type table (k, energy, PLATE vs LoRA)."""
    m = bundle.manifest
    s = m.settings
    src = m.source.get("id", "?") + (f"@{m.source['revision']}" if m.source.get("revision") else "")
    if m.source.get("commit") and m.source.get("commit") != m.source.get("revision"):
        src += f" (commit {str(m.source['commit'])[:12]})"
    console.print(f"[bold]{bundle.path}[/]  ({'complete' if m.complete else 'UNFINISHED: ' + unfinished_state(m)})")
    if not m.complete:
        console.print(f"[red]{escape(unfinished_note(m))}[/]")
    console.print(f"source: {src}   model_type: {m.model_type}   modules: {len(m.modules)}")
    console.print(
        f"r={s.r} tau={s.tau} max_rank={s.max_rank} seed={s.seed} anchors={s.anchors} "
        f"sketch_dim={s.sketch_dim} precision={s.precision} q_dtype={s.q_dtype}"
        + (" include_mtp" if s.include_mtp else "")
    )
    # the layer selection is not in the selection note: without it a one-stack bundle reads as the whole model
    layers = f"; layers {format_layers(s.layers)}" if s.layers is not None else ""
    console.print(f"targets: {escape(m.selection_note + layers)}")
    table = Table(title="per module type")
    for col in ("module type", "count", "d_out x d_in", "mean k", "Q energy", "PLATE r*k", "LoRA r*(din+dout)"):
        table.add_column(col, justify="right" if col != "module type" else "left")
    rows = summary_rows(list(bundle))
    for row in rows:
        table.add_row(
            row["module_type"],
            str(row["count"]),
            str(row["shape"]),
            f"{row['mean_k']:.1f}",
            f"{row['mean_captured_energy']:.2e}",
            f"{row['plate_params']:,}",
            f"{row['lora_params']:,}",
        )
    plate_total = sum(r["plate_params"] for r in rows)
    lora_total = sum(r["lora_params"] for r in rows)
    table.add_row("total", str(len(m.modules)), "", "", "", f"{plate_total:,}", f"{lora_total:,}", style="bold")
    console.print(table)
    no_rows = [rec.name for rec in bundle if rec.r == 0]
    if no_rows:
        console.print(
            f"[yellow]note[/]: {counted(len(no_rows), 'module')} with r = 0 ({no_rows[0]}"
            + (", ..." if len(no_rows) > 1 else "")
            + "): too few output rows to pick redundant ones (r <= 0.9 d_out), so PLATE trains nothing there"
        )
    flat = [rec.name for rec in bundle if rec.r > 0 and rec.total_energy == 0]
    if flat:  # zero-initialised layers (block expansion): the numbers read like any other module's
        console.print(
            f"[yellow]note[/]: {counted(len(flat), 'module')} whose rows outside B are all zero ({flat[0]}"
            + (", ..." if len(flat) > 1 else "")
            + "): no input direction carries energy there, so Q is an arbitrary basis of the whole input space "
            "(k = d_in, within --max-rank) and there is no geometry to inherit (a zero-initialised layer?)"
        )
    stats = bundle.stats()
    if "variant" in stats and "wall_seconds" not in stats:  # an ablation bundle: derived, not scanned
        console.print(f"ablation bundle: {stats['variant']} (seed {stats.get('seed')}) of {stats.get('from')}")
    elif stats:  # an unfinished bundle's statistics are those of the scan that last finished it
        console.print(
            ("scan" if m.complete else "last finished scan (not this unfinished one)")
            + f": {stats.get('wall_seconds', 0):.1f} s, read {human_bytes(stats.get('bytes_read', 0))}, "
            f"peak RSS {human_bytes(stats.get('peak_rss_bytes', 0))}, device {stats.get('device')}"
            + (f" x {stats['world_size']} processes" if stats.get("world_size") else "")
        )
        console.print(reuse_line(stats))
        disagreed = stats.get("manifest_disagreed")
        if isinstance(disagreed, list) and disagreed:  # see rescan_baseline: an edited manifest.json
            console.print(
                f"[yellow]note[/]: manifest.json's record of {counted(len(disagreed), 'module')} ({disagreed[0]}"
                + (", ..." if len(disagreed) > 1 else "")
                + ") disagreed with its part file's header (fingerprint, dtype, shape or layout; the manifest was "
                "edited?): the weights were checked against the part file's record, and the manifest rewritten"
            )


def reuse_line(stats: dict) -> str:
    """'computed 14 of 14 modules' or '1 of 14 modules changed: recomputed 1, kept 13' from a scan's statistics.

    A run that finished an interrupted one says so, and counts the changed modules since the bundle was made, those
    the interrupted run already recomputed included (``modules_changed_earlier``), not only this run's."""
    total = stats.get("modules_total", stats.get("modules_scanned", 0) + stats.get("modules_resumed", 0))
    computed, kept, changed = (
        stats.get("modules_scanned", 0),
        stats.get("modules_resumed", 0),
        stats.get("modules_changed", 0),
    )
    damaged, earlier, resumed = (
        stats.get("modules_damaged", 0),
        stats.get("modules_changed_earlier", 0),
        stats.get("resumed"),  # None: statistics of a version that did not record it
    )
    if damaged:  # the other recomputed modules are named too: changed weights, missing part files
        why = [f"{counted(damaged, 'module')} damaged in the part files (digest mismatch)"]
        if changed:
            why.append(f"{changed} changed since the bundle was made")
        rest = computed - damaged - changed
        if rest > 0:
            why.append(f"{rest} not written yet" if resumed else f"{rest} whose part files were missing or unreadable")
        return f"{', '.join(why)}: recomputed {computed}, kept {kept} of {total}"
    if resumed and changed and "modules_changed_earlier" in stats:  # the finished bundle's weights are known
        return (
            f"resumed an interrupted rescan: {changed} of {total} modules changed since the bundle was made; "
            f"recomputed {earlier} in the interrupted run and {computed} in this one, kept {kept - earlier} unchanged"
        )
    if resumed and changed:  # no finished bundle before the interrupted run (or it did not record one)
        return (
            f"resumed an interrupted scan: kept {kept} finished modules, computed {computed} (of {total}), "
            f"{changed} of them because their weights changed since the interrupted run wrote them"
        )
    if resumed and not computed:
        return f"finished an interrupted scan: all {total} modules were already written (kept {kept}, computed 0)"
    if resumed:
        return f"resumed an interrupted scan: kept {kept} finished modules, computed {computed} (of {total})"
    rescan = resumed is False and "modules_changed_earlier" in stats  # of a finished bundle (its weights known)
    if not kept and not rescan:
        return f"computed {computed} of {total} modules"
    if not changed and not computed:
        return f"no module changed since the bundle was made: kept all {kept}, recomputed 0"
    if changed:
        return f"{changed} of {total} modules changed since the bundle was made: recomputed {computed}, kept {kept}"
    if resumed is False:  # a finished bundle, nothing changed, yet modules computed: their part files were missing
        return f"kept {kept} modules, recomputed {computed} whose part files were missing or unreadable (of {total})"
    return f"resumed: kept {kept} finished modules, computed {computed} (of {total})"


@click.command("scan")
@click.argument("model", required=False)
@click.option("--out", "-o", type=click.Path(path_type=Path), help="Bundle directory [default: bundles/<model name>].")
@click.option("--r", "r", type=int, default=64, show_default=True, help="Redundant output rows per module.")
@click.option("--tau", type=float, default=0.9, show_default=True, help="Energy threshold: larger tau, smaller k.")
@click.option("--max-rank", type=int, default=512, show_default=True, help="Cap on k.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for null-space directions and sketches.")
@click.option("--anchors", type=int, default=256, show_default=True, help="Anchor rows for redundancy scores.")
@click.option("--sketch-dim", type=int, default=None, help="Use the paper's random-projection score with this dim.")
@click.option("--target-modules", default=None, help="Comma-separated module names or regexes (overrides defaults).")
@click.option(
    "--layers",
    default=None,
    help="Layer indices, e.g. '0-3,7' (every stack's); one stack's: 'decoder:0-3'; a whole stack: 'decoder'.",
)
@click.option("--precision", type=click.Choice(["float32", "float64"]), default="float32", show_default=True)
@click.option("--q-dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda (under torchrun: cuda:LOCAL_RANK).")
@click.option(
    "--devices",
    default=None,
    help="One worker process per device, e.g. cuda:0,cuda:1 or 'all' (every visible GPU); without torchrun.",
)
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit).")
@click.option("--offline", is_flag=True, help="Never contact the hub (also HF_HUB_OFFLINE=1).")
@click.option(
    "--include-mtp", is_flag=True, help="Also scan DeepSeek's multi-token-prediction layer (skipped by default)."
)
@click.option("--overwrite", is_flag=True, help="Replace a bundle made with other settings or weights.")
@click.option("--report", "make_report", is_flag=True, help="Also write <out>/report.html.")
@quiet_option()
def scan_command(
    model, out, target_modules, layers, device, devices, revision, offline, overwrite, make_report, quiet, **settings
):
    """Compute redundancy, B, energy spectra, k(tau) and Q for every target module of MODEL.

    MODEL is a local HF-style directory, a single .safetensors file, or a hub repo id (HF cache first).
    Without MODEL, the embedded all-MiniLM-L6-v2 is scanned. Memory stays bounded by the largest module.

    Rerunning into the same --out resumes an interrupted scan and rescans a finished one: every target weight
    is read and hashed once and only modules whose weights changed are recomputed. Under torchrun each rank
    scans its share of the layers (give torchrun's options, then --, then the command).

    \b
    Examples:
      plate-inspect scan
      plate-inspect scan ./my-model-dir --tau 0.8 --out bundles/mine
      plate-inspect scan ./big-model --devices cuda:0,cuda:1 --out bundles/big
      torchrun --nnodes 2 --nproc-per-node 8 --no-python -- plate-inspect scan ./big-model --device cuda --out /shared/b
      plate-inspect scan Qwen/Qwen2.5-7B --tau 0.9 --r 64 --max-rank 512 --out bundles/qwen7b
      plate-inspect scan model.safetensors --target-modules q_proj,v_proj --layers 0-3
    """
    # the remaining options (--r, --tau, ..., --include-mtp) are ScanSettings fields by name: one settings object
    settings = ScanSettings(target_modules=split_names(target_modules), layers=parse_layers(layers), **settings)
    root = rank_from_env().is_root  # under torchrun, rank 0 speaks for the job
    if model is None:
        model = str(default_model_path())
        out = out or Path("bundles") / "all-MiniLM-L6-v2"
        if root:
            err_console.print(f"no model given: scanning {DEFAULT_MODEL_NAME}")
    out = out or default_out_dir(model)
    report_path = scan_report_path(out) if make_report else None  # refused before the scan, not after it
    check_out_dir(out)  # before the checkpoint is opened: a hub model would be downloaded first
    check_devices(device, devices)  # likewise
    plan = plan_scan(model, settings, revision=revision, offline=True if offline else None)
    if root:
        ckpt = plan.checkpoint
        if ckpt.source is not None and ckpt.source.kind == "hub":  # which snapshot of the cache: say so
            err_console.print(
                f"model: {ckpt.source.id} at {ckpt.source.revision}, commit {ckpt.source.commit} ({ckpt.root})",
                soft_wrap=True,
            )
        for note in [*ckpt.notes, *plan.notes]:
            err_console.print(f"note: {escape(note)}", soft_wrap=True)
        err_console.print(f"{counted(len(plan.targets), 'target module')} ({plan.selection_note}) -> {out}")
        before, now = previous_source(out), source_record(plan.checkpoint)
        if before and not overwrite and not same_model(before, now):
            err_console.print(
                f"note: {out} holds a bundle of {before.get('id')}; updating it for {now.get('id')} (only modules "
                "whose weights differ are recomputed; give another --out to keep it)"
            )
    # under torchrun rank 0's bar counts the whole job's modules (every rank posts its count to the job's store)
    world = rank_from_env().world_size
    label = "scan" if world == 1 else f"scan ({world} ranks)"
    with sigterm_as_interrupt(), progress_bar(label, quiet=quiet or not root) as progress:
        bundle = run_scan(plan, out, overwrite=overwrite, device=device, devices=devices, progress=progress)
    if not root:
        return
    print_summary(bundle)
    if report_path is not None:
        write_scan_report(bundle, report_path)
        console.print(f"report: {report_path}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (kill, a batch scheduler's preemption, a container stop) ends the scan as Ctrl-C does: the part file
    being written is finished, the same "interrupted ... rerun to resume" line is printed, exit code 130. Without
    it the process died mid-write: no message, a stray temp file, the layer being written lost. Once it fired, later
    SIGTERMs stay ignored after the scan too: the process is on its way out (exit 130), and torchrun's SIGTERM, late
    after scancel's on a busy node, killed a rank before it had said the interrupted line (say_once ignores one
    while a rank says it; this covers the moment between)."""

    fired = False

    def interrupt(signum: int, frame: object) -> None:
        nonlocal fired
        if fired:  # a second SIGTERM (scancel sends two) while the first unwinds: raising again would land anywhere,
            return  # e.g. in a GC callback ("Exception ignored in ... KeyboardInterrupt") or the part being finished
        fired = True
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        if not fired:
            signal.signal(signal.SIGTERM, previous)


#: Where ``scan --report`` writes its report, inside the bundle directory.
SCAN_REPORT_NAME = "report.html"


def _report_elsewhere(out: Path) -> str:
    """The command that writes the report of a scanned bundle to a file of the user's choice."""
    return f"plate-inspect report {shlex.quote(str(out))} -o FILE.html"


def scan_report_path(out: Path) -> Path:
    """``<out>/report.html``, the path ``scan --report`` writes; ReportError before any scanning when a directory
    is in its way (the scan would finish only to fail there). ``--report`` has no path of its own to change, so the
    message says how to get the report without it."""
    from plate_inspect.errors import ReportError

    path = Path(out) / SCAN_REPORT_NAME
    if path.is_dir():
        raise ReportError(
            f"{path}: is a directory, where scan --report writes the bundle's report; move it away, or scan without "
            f"--report and then run: {_report_elsewhere(Path(out))}"
        )
    return path


def write_scan_report(bundle: Bundle, path: Path) -> None:
    """Write the report of a scanned (complete) bundle; a failed write says the bundle is complete and how to write
    the report elsewhere (not a report command's ``-o``: scan has none for the report)."""
    from plate_inspect.reports import render_report, write_report_text

    elsewhere = _report_elsewhere(bundle.path)
    remedy = f"the bundle in {bundle.path} is complete: write its report elsewhere with: {elsewhere}"
    write_report_text(path, render_report([bundle]), remedy=remedy)


@click.command("info")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--modules", "show_modules", is_flag=True, help="Also list every module.")
@click.option("--expert-groups", "show_groups", is_flag=True, help="Also list every (layer, module type) expert group.")
def info_command(bundle: Path, show_modules: bool, show_groups: bool) -> None:
    """Summarise a PLATE init bundle (settings, per-type k and energy, parameter budgets, expert groups).

    Mixture-of-experts bundles also get one row per expert module type: how many layers x experts, and the
    spread of k, captured energy and mean redundancy over all of them.
    Part files that are missing or truncated (their headers are read, not their tensors: `verify` checks those)
    are named after the summary, and the exit status is then non-zero.

    \b
    Examples:
      plate-inspect info bundles/qwen7b --modules
      plate-inspect info bundles/deepseek-v3 --expert-groups
    """
    import json

    from plate_inspect.checkpoint import parse_safetensors_header
    from plate_inspect.errors import BundleError
    from plate_inspect.reports.data import distribution, expert_groups

    # an adapter given for its bundle (a save_adapter file, a PEFT dir of the plate method): point to the bundle
    made_with, kind = None, "a PLATE adapter (save_adapter)"
    try:
        if bundle.is_file() and bundle.suffix == ".safetensors":
            meta = parse_safetensors_header(bundle)[1]
            made_with = meta.get("bundle_path") if meta.get("format") == "plate-adapter" else None
        elif (bundle / "adapter_config.json").is_file():
            config = json.loads((bundle / "adapter_config.json").read_text())
            made_with = config.get("bundle") if config.get("peft_type") == "PLATE" else None
            kind = "a PEFT adapter of the plate method (save_pretrained)"
    except (OSError, ValueError, AttributeError, PlateInspectError):
        made_with = None  # unreadable: Bundle.load says what the path is
    if made_with and (Path(made_with) / "manifest.json").is_file():
        raise BundleError(
            f"{bundle}: {kind}, not a bundle; it was trained with the bundle {made_with}: "
            f"plate-inspect info {made_with}"
        )
    if made_with:
        raise BundleError(
            f"{bundle}: {kind}, not a bundle; it was trained with the bundle {made_with}, which is not there (moved "
            "or deleted?): run plate-inspect info on its new place (audit and merge take it as --bundle)"
        )
    b = Bundle.load(bundle, require_complete=False)
    print_summary(b)
    groups = expert_groups(list(b))
    if groups:
        by_type: dict[str, list] = defaultdict(list)
        for g in groups:
            by_type[g.module_type].append(g)
        table = Table(title="expert groups, per module type (over all experts)")
        for col in ("expert module type", "layers x experts", "d_out x d_in", "k min/median/max", "Q energy", "score"):
            table.add_column(col, justify="left" if col == "expert module type" else "right")
        for mtype, members in by_type.items():
            ks = distribution([k for g in members for k in g.k])
            energy = distribution([x for g in members for x in g.energy])
            score = distribution([x for g in members for x in g.score])
            n_experts = sorted({len(g.names) for g in members})
            table.add_row(
                mtype,
                f"{len(members)} x {'/'.join(map(str, n_experts))}",
                f"{members[0].shape[0]}x{members[0].shape[1]}",
                f"{ks['min']:.0f}/{ks['median']:.0f}/{ks['max']:.0f}",
                f"{energy['median']:.2e}",
                f"{score['median']:.4f}",
            )
        console.print(table)
        console.print("[dim]Q energy and score: medians over the experts; --expert-groups lists every layer[/]")
    if show_groups and not groups:
        console.print("--expert-groups: no expert modules in this bundle (a dense model); nothing to group")
    if show_groups and groups:
        table = Table(title="expert groups, per layer")
        for col in ("layer", "module type", "experts", "k min/median/max", "Q energy (median)", "score (median)"):
            table.add_column(col, justify="left" if col == "module type" else "right")
        for g in groups:
            ks, energy, score = distribution(g.k), distribution(g.energy), distribution(g.score)
            table.add_row(
                str(g.layer),
                g.module_type,
                str(len(g.names)),
                f"{ks['min']:.0f}/{ks['median']:.0f}/{ks['max']:.0f}",
                f"{energy['median']:.2e}",
                f"{score['median']:.4f}",
            )
        console.print(table)
    if show_modules:
        table = Table(title="modules")
        for col in ("module", "d_out x d_in", "r", "k", "Q energy", "mean score"):
            table.add_column(col)
        for rec in b:
            table.add_row(
                rec.name,
                str(rec.shape),
                str(rec.r),
                str(rec.k),
                f"{rec.captured_energy:.2e}",
                f"{rec.mean_redundancy:.4f}",
            )
        console.print(table)
    b.check_parts()  # the summary is the manifest's: a missing or truncated part file is an error after it


#: How many of verify's problem lines are printed; the rest are counted (``--json`` has them all).
PROBLEMS_SHOWN = 10


@click.command("verify")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("model", required=False)
@click.option("--revision", default=None, help="Hub revision of MODEL.")
@click.option(
    "--exact",
    is_flag=True,
    help="Also check every Q against a float64 dense oracle on MODEL's weights (slow: an eigvalsh per module).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout (same exit codes).")
@quiet_option()
def verify_command(
    bundle: Path, model: str | None, revision: str | None, exact: bool, as_json: bool, quiet: bool
) -> None:
    """Check BUNDLE's tensors, and that it was made for MODEL's weights (exit 1 if not).

    \b
    Examples:
      plate-inspect verify bundles/qwen7b Qwen/Qwen2.5-7B
      plate-inspect verify bundles/mine            # structure only
      plate-inspect verify bundles/mine ./my-model --exact
      plate-inspect verify bundles/mine ./my-model --json | jq .changed
    """
    from plate_inspect.verification import verify

    with progress_bar("verify", transient=True, quiet=as_json or quiet) as progress:
        report = verify(bundle, model, revision=revision, progress=progress, exact=exact)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
        raise SystemExit(0 if report.ok else 1)
    for problem in report.problems[:PROBLEMS_SHOWN]:
        console.print(f"[red]x[/] {problem}")
    if len(report.problems) > PROBLEMS_SHOWN:  # a bundle of another model: one line per module buried the summary
        more = len(report.problems) - PROBLEMS_SHOWN
        console.print(f"[red]x[/] ... and {counted(more, 'more problem')} (--json lists every one)")
    for note in report.notes:
        console.print(f"[yellow]note[/]: {note}")
    if report.exactness:
        worst = max(report.exactness.items(), key=lambda item: item[1].used)
        console.print(
            f"exactness: {counted(len(report.exactness), 'module')} checked against the float64 dense oracle; "
            f"largest share of the allowance used: {worst[1].used:.3g} ({worst[0]})"
            + (
                " (over 1, but within the rounding of Q's stored dtype, which the check allows for)"
                if worst[1].used > 1 and worst[1].ok
                else ""
            )
        )
    target = f" against {model}" if model else ""
    if report.ok:
        console.print(f"[green]ok[/]: {report.modules_checked} modules verified{target}")
    else:
        console.print(
            f"[red]FAILED[/]: {counted(len(report.problems), 'problem')} in "
            f"{counted(report.modules_checked, 'module')}{target}"
        )
        raise SystemExit(1)
