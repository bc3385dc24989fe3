"""Documents read in epoch order: every document once per epoch, each epoch in its own seeded permutation.

The epochs, one after another, form one token stream; step ``s`` (from 1) takes the stream's next slice:
as fixed windows (``ShardWindows``: ``global_batch`` rows of ``seq_len + 1`` tokens, consecutive rows
sharing one token, as nanoGPT reads its ``.bin``) or as packed documents (runtime/documents.py
``CorpusDocuments``: ``tokens_per_step`` tokens, the documents and the parts of the first and last that the
slice covers). Each step is a pure function of its number, so the data position a checkpoint records is the
step (with the epoch and offset it stands for), and a resumed run reads, under any plan, what the
uninterrupted run would have.

Documents come as shards of (token array, offsets): the memory maps of a ``hspmd data prepare`` directory
(runtime/token_shards.py writes them), or a small corpus held in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.torchfree.errors import Problem, SpecError

if TYPE_CHECKING:
    import numpy as np

FORMAT = "hspmd-tokens/1"
META = "meta.json"


class TokenDocuments:
    """Documents as (token array, offsets) shards: a prepared directory's memory maps, or a small corpus
    held in memory. ``lengths``: every document's token count, in shard order."""

    def __init__(self, shards: list[tuple[np.ndarray, np.ndarray]], origin: str, eos: int | None = None,
                 vocab_size: int = 0) -> None:
        import numpy as np

        self.shards, self.origin, self.eos, self.vocab_size = shards, origin, eos, vocab_size
        self.lengths = np.concatenate([np.diff(idx) for _, idx in shards]) if shards else np.zeros(0, np.int64)
        self.first = np.cumsum([0] + [len(idx) - 1 for _, idx in shards])  # global id of each shard's first doc
        self.tokens = int(self.lengths.sum())

    def clipped(self, max_len: int) -> TokenDocuments:
        """The same documents, each cut to its first ``max_len`` tokens (the truncate policy)."""
        import numpy as np

        out = TokenDocuments(self.shards, self.origin, self.eos, self.vocab_size)
        out.lengths = np.minimum(self.lengths, max_len)
        out.tokens = int(out.lengths.sum())
        return out

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        import numpy as np

        s = int(np.searchsorted(self.first, doc, side="right")) - 1
        tokens, idx = self.shards[s]
        base = int(idx[doc - int(self.first[s])])
        return np.asarray(tokens[base + start:base + stop], dtype=np.int64)


def open_prepared(directory: Path) -> TokenDocuments:
    """A ``data prepare`` directory, memory-mapped (the files are checked against ``meta.json``)."""
    import numpy as np

    from runtime.torchfree.spec.hf import read_config

    meta_path = directory / META
    if not meta_path.is_file():
        raise SpecError([Problem(str(directory), "--data", f"is a directory without {META}: expected a text or JSONL "
                                                           "file, or a directory of hspmd data prepare")])
    meta = read_config(meta_path)
    if meta.get("format") != FORMAT:
        raise SpecError([Problem(str(meta_path), "format", f"expected {FORMAT!r}, got {meta.get('format')!r}"[:200])])
    if meta.get("dtype") not in ("uint16", "uint32") or not isinstance(meta.get("shards"), list):
        raise SpecError([Problem(str(meta_path), "dtype", "expected uint16 or uint32, and a list of shards")])
    shards = []
    for i, s in enumerate(meta["shards"]):
        where = f"shards[{i}]"
        try:
            tokens_path, index_path = directory / s["tokens_file"], directory / s["index_file"]
            tokens = np.memmap(tokens_path, dtype=meta["dtype"], mode="r") if s["tokens"] else np.zeros(0, "uint16")
            idx = np.memmap(index_path, dtype=np.int64, mode="r")
        except (KeyError, TypeError, OSError, ValueError) as exc:
            raise SpecError([Problem(str(meta_path), where, f"unreadable shard: {exc}"[:200])]) from None
        if len(idx) != s["documents"] + 1 or len(tokens) != s["tokens"] or int(idx[-1]) != len(tokens):
            raise SpecError([Problem(str(meta_path), where, f"{tokens_path.name}/{index_path.name} do not match "
                                                            "their documents and tokens counts (truncated?)")])
        shards.append((tokens, idx))
    vocab = meta.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise SpecError([Problem(str(meta_path), "vocab_size", f"expected a positive integer, got {vocab!r}"[:200])])
    return TokenDocuments(shards, str(directory), meta.get("eos_id"), vocab)


class EpochStream:
    """The documents of every epoch, each epoch in its seeded permutation, as one token stream."""

    def __init__(self, docs: TokenDocuments, seed: int) -> None:
        if docs.tokens == 0:
            raise SpecError([Problem(docs.origin, "data", "no tokens")])
        self.docs, self.seed = docs, seed
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s document order and the stream offset (within the epoch) where each starts."""
        import numpy as np

        if epoch not in self._epochs:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            perm = rng.permutation(len(self.docs.lengths))
            starts = np.concatenate([[0], np.cumsum(self.docs.lengths[perm])[:-1]])
            if len(self._epochs) >= 2:   # a step spans at most two epochs
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (perm, starts)
        return self._epochs[epoch]

    def pieces(self, start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
        """(epoch, document, first token, end token) of each document part in stream range [start, stop)."""
        import numpy as np

        total = self.docs.tokens
        at = start
        while at < stop:
            epoch, offset = divmod(at, total)
            perm, starts = self.order(epoch)
            i = int(np.searchsorted(starts, offset, side="right")) - 1
            while at < stop and i < len(perm):
                doc = int(perm[i])
                a = offset - int(starts[i])
                b = min(int(self.docs.lengths[doc]), a + (stop - at))
                yield epoch, doc, a, b
                at += b - a
                offset += b - a
                i += 1

    def tokens(self, start: int, stop: int) -> np.ndarray:
        import numpy as np

        return np.concatenate([self.docs.read(d, a, b) for _, d, a, b in self.pieces(start, stop)])

    def position(self, offset: int) -> dict[str, object]:
        epoch, within = divmod(offset, self.docs.tokens)
        return {"epoch": epoch, "epoch_offset": within, "stream_offset": offset}


@dataclass
class ShardWindows:
    """Fixed windows of the epoch stream: step ``s`` reads ``global_batch`` rows of ``seq_len + 1`` tokens
    from offset ``(s - 1) * global_batch * seq_len``, consecutive rows sharing one token."""

    stream: EpochStream
    global_batch: int
    seq_len: int

    def batch(self, step: int):  # -> torch.Tensor
        import torch

        base = (step - 1) * self.global_batch * self.seq_len
        flat = torch.from_numpy(self.stream.tokens(base, base + self.global_batch * self.seq_len + 1))
        return flat.unfold(0, self.seq_len + 1, self.seq_len).contiguous()

    def position(self, step: int) -> dict[str, object]:
        return {"source": self.stream.docs.origin, "step": step,
                **self.stream.position(step * self.global_batch * self.seq_len)}

    def describe(self) -> str:
        d = self.stream.docs
        return (f"data: {d.origin}: {len(d.lengths)} prepared documents, {d.tokens} tokens (EOS id {d.eos}), "
                f"{self.global_batch} windows of {self.seq_len + 1} tokens per step, epoch order")


def in_memory(documents: list[tuple[int, ...]] | tuple[tuple[int, ...], ...], origin: str) -> TokenDocuments:
    """A small corpus' documents as one in-memory shard."""
    import numpy as np

    lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
    idx = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter((t for d in documents for t in d), dtype=np.int64, count=int(idx[-1]))
    return TokenDocuments([(tokens, idx)], origin)


def step_parts(stream: EpochStream, tokens_per_step: int, max_len: int, step: int
               ) -> list[tuple[int, int, int, int]]:
    """(epoch, document, first token, end token) of the parts of step ``step``'s slice (``tokens_per_step``
    tokens from ``(step - 1) * tokens_per_step``), a document longer than ``max_len`` cut at every multiple of
    ``max_len`` from its start (the split policy: no part trains across a cut)."""
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    start = (step - 1) * tokens_per_step
    out = []
    for epoch, doc, a, b in stream.pieces(start, start + tokens_per_step):
        while a < b:
            end = min(b, (a // max_len + 1) * max_len)
            out.append((epoch, doc, a, end))
            a = end
    return out
