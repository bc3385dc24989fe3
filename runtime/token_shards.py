"""Corpora tokenized once into memory-mapped token shards, and read back in epoch order.

``hspmd data prepare CORPUS... --tokenizer tokenizer.json -o DIR`` writes (the Megatron / nanoGPT layout:
flat token arrays that numpy memory-maps, and an index of where each document starts):

* ``DIR/shard-00000.bin``: the tokens of consecutive documents, ``uint16`` when the vocabulary fits, else
  ``uint32``; every document ends with the tokenizer's EOS, and starts with its BOS where its config asks;
* ``DIR/shard-00000.idx``: ``int64`` offsets into the shard, one per document plus the end;
* ``DIR/meta.json``: the format, dtype, vocabulary, special tokens, and per shard its documents and tokens.

Preparing streams: documents are read one at a time, tokenized in batches whose text stays under the memory
budget, appended to the open shard, and the shard is cut at ``shard_tokens``; nothing grows with the corpus
but the output files. The directory appears only once complete (written beside it, then renamed).

Reading them in epoch order: runtime/epochs.py.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.epochs import FORMAT, META
from runtime.torchfree.errors import HspmdError, Problem, SpecError
from runtime.torchfree.special_tokens import SpecialTokens, special_tokens

if TYPE_CHECKING:
    import numpy as np

DEFAULT_SHARD_TOKENS = 2**28  # 512 MiB of uint16 tokens per shard
DEFAULT_MAX_MEMORY = 256 * 2**20


# ---------------------------------------------------------------------------------------------------------
# Reading corpora one document at a time


def corpus_format(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


def iter_documents(path: Path) -> Iterator[tuple[str, str]]:
    """(origin, text) per document: JSONL (a ``text`` field per line), Parquet (a ``text`` column, read
    with pyarrow when it is installed) or plain text (blocks separated by blank lines)."""
    from runtime.documents import iter_jsonl, iter_text_blocks

    fmt = corpus_format(path)
    if fmt == "jsonl":
        yield from iter_jsonl(path)
    elif fmt == "parquet":
        yield from _iter_parquet(path)
    else:
        for where, raw in iter_text_blocks(path):
            try:
                yield where, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SpecError([Problem(where, "", f"not UTF-8 (byte {exc.start} of the document)")]) from None


def require_pyarrow(path: Path) -> None:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise HspmdError(f"{path}: Parquet needs pyarrow, which is not installed (pip install pyarrow)") from None


def _iter_parquet(path: Path) -> Iterator[tuple[str, str]]:
    require_pyarrow(path)
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except (OSError, ValueError) as exc:
        raise SpecError([Problem(str(path), "", f"not a readable Parquet file: {exc}")]) from None
    if "text" not in f.schema_arrow.names:
        raise SpecError([Problem(str(path), "text", f"no such column (columns: {', '.join(f.schema_arrow.names)})")])
    row = 0
    for batch in f.iter_batches(batch_size=1024, columns=["text"]):
        for value in batch.column(0).to_pylist():
            row += 1
            if not isinstance(value, str):
                raise SpecError([Problem(f"{path}:row {row}", "text", f"expected a string, got {value!r}"[:120])])
            yield f"{path}:row {row}", value


# ---------------------------------------------------------------------------------------------------------
# Preparing


@dataclass(frozen=True)
class Prepared:
    directory: Path
    documents: int
    tokens: int
    shards: int
    empty: int  # documents whose text tokenized to nothing (EOS/BOS alone are not written)
    special: SpecialTokens


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


class _ShardWriter:
    """The open shard: tokens appended to its .bin, document offsets to its .idx."""

    def __init__(self, directory: Path, dtype: str, shard_tokens: int) -> None:
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._bin = self._idx = None
        self._tokens = 0

    def _open(self) -> None:
        n = len(self.shards)
        self.shards.append({"tokens_file": f"shard-{n:05d}.bin", "index_file": f"shard-{n:05d}.idx",
                            "documents": 0, "tokens": 0})
        self._bin = open(self.directory / self.shards[-1]["tokens_file"], "wb")
        self._idx = open(self.directory / self.shards[-1]["index_file"], "wb")
        self._tokens = 0

    def add(self, documents: list[np.ndarray]) -> None:
        import numpy as np

        for doc in documents:
            if self._bin is None or (self._tokens and self._tokens + len(doc) > self.shard_tokens):
                self._close_shard()
                self._open()
            assert self._bin is not None and self._idx is not None
            np.asarray([self._tokens], dtype=np.int64).tofile(self._idx)
            doc.astype(self.dtype, copy=False).tofile(self._bin)
            self._tokens += len(doc)
            self.shards[-1]["documents"] += 1
            self.shards[-1]["tokens"] += len(doc)

    def _close_shard(self) -> None:
        import numpy as np

        if self._bin is None or self._idx is None:
            return
        np.asarray([self._tokens], dtype=np.int64).tofile(self._idx)
        for f in (self._bin, self._idx):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._bin = self._idx = None

    def close(self) -> list[dict[str, Any]]:
        self._close_shard()
        return self.shards


def prepare_corpus(corpora: Iterable[Path], tokenizer: Path, out: Path, *, eos: str | None = None,
                   max_memory: int = DEFAULT_MAX_MEMORY, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                   progress: Callable[[int], None] | None = None) -> Prepared:
    """Tokenize ``corpora`` into ``out`` (which must not exist); ``progress``: told the bytes of text read
    so far after each batch. Text is tokenized in batches of ``max_memory // 128`` characters: a batch's
    text, its encodings (Python objects, ~40 bytes per token) and its arrays stay within ``max_memory``."""
    import numpy as np

    from runtime.documents import HFTokenizer

    corpora = list(corpora)
    for path in corpora:   # before any work: a missing optional dependency is not found after hours
        if corpus_format(path) == "parquet":
            require_pyarrow(path)
    if os.path.lexists(out):
        raise HspmdError(f"{out}: -o: exists; remove it or name another directory")
    tok = HFTokenizer(tokenizer)
    special = special_tokens(Path(tokenizer), tok.backend, eos)
    dtype = token_dtype(tok.vocab_size)
    budget = max(1, max_memory // 128)  # text bytes per batch: its encodings cost tens of bytes per character
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex}.tmp"
    tmp.mkdir()
    done_bytes = documents = tokens = empty = 0
    try:
        writer = _ShardWriter(tmp, dtype, shard_tokens)
        head = [special.bos] if special.bos is not None else []
        batch: list[str] = []
        size = 0

        def flush() -> None:
            nonlocal documents, tokens, empty
            encodings = tok.backend.encode_batch(batch, add_special_tokens=False)
            docs = []
            for e in encodings:
                if not e.ids:
                    empty += 1
                    continue
                docs.append(np.asarray([*head, *e.ids, special.eos], dtype=np.int64))
            writer.add(docs)
            documents += len(docs)
            tokens += sum(len(d) for d in docs)
            batch.clear()

        for path in corpora:
            for _where, text in iter_documents(path):
                batch.append(text)
                size += len(text)
                if size >= budget:
                    flush()
                    done_bytes += size
                    size = 0
                    if progress is not None:
                        progress(done_bytes)
        if batch:
            flush()
        done_bytes += size
        if progress is not None:
            progress(done_bytes)
        shards = writer.close()
        if documents == 0:
            raise HspmdError(f"{', '.join(map(str, corpora))}: no non-empty document ({empty} empty skipped)")
        meta = {"format": FORMAT, "dtype": dtype, "vocab_size": tok.vocab_size, "tokenizer": str(tokenizer),
                "eos_id": special.eos, "bos_id": special.bos, "documents": documents, "tokens": tokens,
                "sources": [str(p) for p in corpora], "shards": shards}
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Prepared(out, documents, tokens, len(shards), empty, special)
