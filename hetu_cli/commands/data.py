"""``hspmd data prepare CORPUS... --tokenizer tokenizer.json -o DIR``: tokenize once into token shards."""

from __future__ import annotations

import os
import re
from pathlib import Path

import click
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from hetu_cli.output import IntRange, console
from runtime.torchfree.errors import HspmdError

SIZE = re.compile(r"([0-9]+)\s*(B|KiB|MiB|GiB|TiB)?")
UNITS = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
MIN_MEMORY = 2**20


def parse_size(text: str, option: str) -> int:
    m = SIZE.fullmatch(text.strip())
    if m is None:
        raise HspmdError(f"{option}: expected a size such as 512MiB or 2GiB (B, KiB, MiB, GiB, TiB), got {text!r}")
    return int(m[1]) * UNITS[m[2]]


@click.group()
def data() -> None:
    """Prepare training data: tokenize corpora once into memory-mapped token shards (docs/training.md)."""


@data.command()
@click.argument("corpus", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--tokenizer", required=True, type=click.Path(path_type=Path),
              help="A local Hugging Face tokenizer.json; EOS and BOS come from the tokenizer_config.json beside it.")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path),
              help="The directory to create: shard-NNNNN.bin (tokens), shard-NNNNN.idx (document offsets), meta.json.")
@click.option("--eos", metavar="TOKEN", help="The end-of-document token's text [default: tokenizer_config.json's "
                                             "eos_token].")
@click.option("--max-memory", default="256MiB", show_default=True, metavar="SIZE",
              help="Memory the tokenizing may use for its batches (text, encodings, arrays), whatever the corpus' "
                   "size.")
@click.option("--shard-tokens", type=IntRange(min=1), default=2**28, show_default=True,
              help="Tokens per shard file at most (a longer document gets a shard of its own).")
def prepare(corpus: tuple[Path, ...], tokenizer: Path, out: Path, eos: str | None, max_memory: str,
            shard_tokens: int) -> None:
    """Tokenize CORPUS (JSONL with a `text` field per line, Parquet with a `text` column, or plain text with
    documents separated by blank lines) into token shards that `hspmd train --data DIR` reads in epoch order.
    An EOS token ends every document; a BOS starts each where the tokenizer's config says add_bos_token."""
    from runtime.token_shards import prepare_corpus

    budget = parse_size(max_memory, "--max-memory")
    if budget < MIN_MEMORY:
        raise HspmdError(f"--max-memory: {max_memory} is below the 1MiB a batch of documents needs")
    for path in corpus:
        if not path.is_file():
            raise HspmdError(f"{path}: CORPUS: " + ("is a directory, expected a file" if path.is_dir()
                                                    else "file not found"))
    total = sum(os.path.getsize(p) for p in corpus)
    err = console(stderr=True)
    with Progress(TextColumn("[bold]tokenizing[/bold]"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("tokenizing", total=total)
        # Progress counts characters of text read against the files' bytes: close for mostly-ASCII corpora.
        result = prepare_corpus(corpus, tokenizer, out, eos=eos, max_memory=budget, shard_tokens=shard_tokens,
                                progress=lambda done: bar.update(task, completed=min(done, total)))
    out_console = console()
    out_console.print(f"{escape(str(result.directory))}: {result.documents:,} documents, {result.tokens:,} tokens "
                      f"in {result.shards} shard(s); {escape(result.special.why)}"
                      + (f"; {result.empty} empty document(s) skipped" if result.empty else ""))
