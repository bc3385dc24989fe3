"""The files of a Hugging Face model directory besides its config and weights that make it usable as it is:
the tokenizer and the generation settings. A checkpoint (``--save``) and an export carry them over from the
model directory they came from, so that ``AutoTokenizer.from_pretrained`` and ``generate`` work on the
result."""

from __future__ import annotations

import os
from pathlib import Path

from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec.io import atomic_write_bytes, is_file, why_not

# The tokenizer files transformers writes (fast and slow tokenizers) and the generation config.
SIDE_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                               "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt",
                               "chat_template.jinja", "generation_config.json")


def side_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The side files present in ``directory`` (regular files only), in ``SIDE_FILES`` order."""
    d = Path(directory)
    return [d / name for name in SIDE_FILES if is_file(d / name)]


def copy_side_files(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> list[Path]:
    """Copy ``source``'s side files into ``target`` (each written atomically; an existing one replaced);
    return the paths written. A source that is not a directory, or holds none, copies nothing."""
    out = []
    for src in side_files(source):
        dst = Path(target) / src.name
        if dst.exists() and dst.resolve() == src.resolve():
            continue
        try:
            data = src.read_bytes()
        except OSError as err:
            raise HspmdError(f"{src}: cannot read: {why_not(err)}") from None
        atomic_write_bytes(dst, data)
        out.append(dst)
    return out
