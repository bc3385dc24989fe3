"""``hspmd export --checkpoint DIR --out HFDIR``: a checkpoint as a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape

from hetu_cli.output import FORMAT_OPTION, console, emit_json
from runtime.checkpoint import EXPORT_DTYPES, export_checkpoint
from runtime.torchfree.hf_files import copy_side_files, side_files
from runtime.torchfree.spec.catalog import model_source_config


def carry_side_files(source: Path, model_ref: str | None, out: Path) -> list[Path]:
    """The tokenizer and generation config files into the export: the checkpoint's own (``--save`` carries
    them), else those of the Hugging Face directory ``--model`` names."""
    if side_files(source):
        return copy_side_files(source, out)
    config = None if model_ref is None else model_source_config(model_ref)
    return [] if config is None else copy_side_files(config.parent, out)


@click.command()
@click.option("--checkpoint", "source", required=True, type=click.Path(path_type=Path),
              help="A --save directory (or the older checkpoint.safetensors format).")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path),
              help="Directory to write (config.json, model.safetensors, and the tokenizer and generation config "
                   "files of the checkpoint or of --model's directory; from_pretrained opens it).")
@click.option("--dtype", type=click.Choice(sorted(EXPORT_DTYPES)), default="fp32", show_default=True,
              help="Weight dtype of the export (training keeps fp32 master weights).")
@click.option("--model", "model_ref", help="The checkpoint's model (catalog name or path), when it has no "
                                           "config.json and its metadata names no catalog entry.")
@FORMAT_OPTION
def export(source: Path, out: Path, dtype: str, model_ref: str | None, fmt: str) -> None:
    """Write a checkpoint's weights as a Hugging Face directory (no optimizer state)."""
    written = export_checkpoint(source, out, dtype=dtype, model_ref=model_ref)
    written += carry_side_files(source, model_ref, out)
    if fmt == "json":
        emit_json({"checkpoint": str(source), "out": str(out), "dtype": EXPORT_DTYPES[dtype],
                   "files": [str(p) for p in written]})
        return
    console().print(f"exported {escape(str(source))} to [bold]{escape(str(out))}[/bold] "
                    f"({EXPORT_DTYPES[dtype]}; {', '.join(escape(p.name) for p in written)})")
