"""Training data: every rank computes the same global batch for a step from (seed, step) alone.

No rank reads data on behalf of another and nothing is communicated: each step's batch is a pure
function of the step number, so a run resumed from a checkpoint at step k sees exactly the batches an
uninterrupted run would have seen, under any plan. The plan's engine splits the global batch across
pipelines. Two sources:

* a synthetic stream (default): arithmetic sequences modulo the vocabulary with a random start and
  stride, so the loss visibly falls within a few dozen steps (pure noise would stay at log(vocab));
* a local text file read as bytes (token = byte value, vocabulary 256; nothing is downloaded), sampled
  as windows at random offsets;
* a ``hspmd data prepare`` directory: consecutive windows of its documents in epoch order
  (runtime/epochs.py ``ShardWindows``).
"""

from __future__ import annotations

import mmap
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from runtime.torchfree.errors import HspmdError

if TYPE_CHECKING:
    import torch

MAX_STRIDE = 7
BYTE_VOCAB = 256


class TokenSource(Protocol):
    global_batch: int
    seq_len: int

    def batch(self, step: int) -> torch.Tensor:
        """LongTensor [global_batch, seq_len + 1] (inputs and shifted labels) for this step."""
        ...

    def position(self, step: int) -> dict[str, object]:
        """Where the data stands once ``step`` is done (recorded in checkpoints, JSON-able)."""
        ...


def _generator(seed: int, step: int, stream: str) -> torch.Generator:
    import torch  # here, not at the top: the launcher checks --data before it imports torch

    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 7_919 + zlib.crc32(stream.encode())) % (2**63))
    return g


@dataclass(frozen=True)
class SyntheticTokens:
    """Arithmetic sequences ``(start + stride * i) mod vocab``: learnable from two tokens of context."""

    vocab_size: int
    global_batch: int
    seq_len: int
    seed: int = 0

    def batch(self, step: int) -> torch.Tensor:
        import torch

        g = _generator(self.seed, step, "synthetic")
        start = torch.randint(0, self.vocab_size, (self.global_batch, 1), generator=g)
        stride = torch.randint(1, MAX_STRIDE + 1, (self.global_batch, 1), generator=g)
        pos = torch.arange(self.seq_len + 1).unsqueeze(0)
        return (start + stride * pos) % self.vocab_size

    def position(self, step: int) -> dict[str, object]:
        return {"source": "synthetic", "step": step}


class ByteTextTokens:
    """Windows of ``seq_len + 1`` bytes at seeded random offsets of a local file (memory-mapped)."""

    def __init__(self, path: str | Path, global_batch: int, seq_len: int, seed: int = 0) -> None:
        self.path = Path(path)
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.seed = seed
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except FileNotFoundError:
            raise HspmdError(f"{self.path}: --data: file not found") from None
        except IsADirectoryError:
            raise HspmdError(f"{self.path}: --data: is a directory, expected a text file") from None
        except OSError as exc:
            raise HspmdError(f"{self.path}: --data: cannot read: {exc.strerror or exc}") from None
        self.size = size
        if size < seq_len + 1:
            raise HspmdError(f"{self.path}: --data: {size} bytes, but a sample of seq_len {seq_len} needs at least "
                             f"{seq_len + 1}")

    def batch(self, step: int) -> torch.Tensor:
        import torch

        assert self._mm is not None
        g = _generator(self.seed, step, "bytes")
        n = self.seq_len + 1
        offsets = torch.randint(0, self.size - n + 1, (self.global_batch,), generator=g).tolist()
        raw = b"".join(self._mm[o:o + n] for o in offsets)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.long).view(self.global_batch, n)

    def position(self, step: int) -> dict[str, object]:
        return {"source": "bytes", "file": str(self.path), "step": step}


def token_source(*, vocab_size: int, global_batch: int, seq_len: int, seed: int,
                 data_file: str | Path | None = None) -> TokenSource:
    """The synthetic stream, or byte tokens of ``data_file`` (which needs a vocabulary of at least 256)."""
    if data_file is None:
        return SyntheticTokens(vocab_size, global_batch, seq_len, seed)
    if Path(data_file).is_dir():   # a ``hspmd data prepare`` directory: windows of its epoch-ordered stream
        from runtime.epochs import EpochStream, ShardWindows, open_prepared

        docs = open_prepared(Path(data_file))
        if docs.vocab_size > vocab_size:
            raise HspmdError(f"{data_file}: --data: its tokens come from a vocabulary of {docs.vocab_size}, more "
                             f"than the model's {vocab_size}")
        return ShardWindows(EpochStream(docs, seed), global_batch, seq_len)
    if vocab_size < BYTE_VOCAB:
        raise HspmdError(f"{data_file}: --data: byte-level tokens need a vocabulary of at least {BYTE_VOCAB}, "
                         f"the model has {vocab_size}")
    return ByteTextTokens(data_file, global_batch, seq_len, seed)
