"""``merge``: merge a trained PLATE adapter into its base checkpoint and write it (Sequential PLATE's step)."""

from __future__ import annotations

from pathlib import Path

import click

from plate_inspect.cli.common import console, err_console, progress_bar, quiet_option
from plate_inspect.formatting import counted


@click.command("merge")
@click.argument("checkpoint")
@click.argument("adapter", type=click.Path(path_type=Path, exists=True))  # a PEFT directory gets its own message
@click.option(
    "--out", "-o", type=click.Path(path_type=Path), required=True, help="Directory for the merged checkpoint."
)
@click.option(
    "--bundle",
    type=click.Path(path_type=Path),
    default=None,
    help="Bundle [default: the adapter's]; its new place when it was moved.",
)
@click.option(
    "--rescan",
    "rescan_out",
    type=click.Path(path_type=Path),
    default=None,
    help="Also rescan the merged checkpoint into this bundle directory (same settings as the old bundle); "
    "an existing bundle there is replaced only with --overwrite.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace the checkpoint in --out as a whole, so that a crash leaves the old or the new one (its files "
    "the new one does not write are removed; other files are kept), and the bundle in --rescan.",
)
@quiet_option()
def merge_command(
    checkpoint: str,
    adapter: Path,
    out: Path,
    bundle: Path | None,
    rescan_out: Path | None,
    overwrite: bool,
    quiet: bool,
) -> None:
    """Write CHECKPOINT with ADAPTER merged in: W[B] += rho A Q^T.

    CHECKPOINT is the safetensors checkpoint (directory or file) the adapter was trained on; ADAPTER is a
    safetensors file written by plate_inspect.train.layer.save_adapter (merge a PEFT adapter directory, from
    save_pretrained, with PeftModel.from_pretrained(...).merge_and_unload()). The merged checkpoint keeps the file
    names, tensor names, dtypes and layout (GPT-2 Conv1D stays [d_in, d_out]); config.json, the generation config,
    tokenizer and chat-template files and a remote-code model's *.py are copied, so OUT loads with
    from_pretrained (model and tokenizer).
    The adapter's recorded weight fingerprints and B/Q digests must match, otherwise nothing is written.

    \b
    Examples:
      plate-inspect merge ./my-model adapter.safetensors --out ./my-model-task1
      plate-inspect merge ./my-model adapter.safetensors --out ./my-model-task1 --rescan bundles/task2
      plate-inspect merge ./my-model adapter.safetensors --out ./my-model-task1 -q
    """
    from plate_inspect.train.sequential import check_rescan_out, merge_checkpoint, rescan

    if rescan_out is not None:
        check_rescan_out(rescan_out, overwrite)
    with progress_bar("merge", quiet=quiet) as progress:  # notes as they arise (what killed merges left: first)
        result = merge_checkpoint(
            checkpoint,
            adapter,
            out,
            bundle=bundle,
            overwrite=overwrite,
            progress=progress,
            on_note=lambda note: err_console.print(f"[yellow]note[/]: {note}"),
        )
    console.print(
        f"merged {counted(len(result.merged_modules), 'module')} into {counted(len(result.files), 'file')} "
        f"in [bold]{result.out}[/]"
    )
    if rescan_out is not None:
        from plate_inspect.train.layer import read_adapter

        _, meta = read_adapter(adapter)
        with progress_bar("rescan", quiet=quiet) as progress:
            new = rescan(result.out, bundle or meta["bundle_path"], rescan_out, overwrite=overwrite, progress=progress)
        err_console.print(f"rescanned: {counted(len(new), 'module')} -> {new.path}")
