"""Writing a checkpoint directory tensor by tensor, with the writer's host memory bounded by one tensor.

``safetensors.torch.save`` builds a whole file's bytes in memory, so a writer that used it held the full
model and both AdamW moments (12 bytes per parameter) at once. A checkpoint's tensors are all known before
the first arrives (the model fixes every name, shape and dtype), so each file's header, and with it each
tensor's byte offset, is written up front; a tensor is then written at its offset as soon as it arrives (in
any order) and dropped. The files are safetensors files like any other: the header is the format's (an
8-byte little-endian length, then JSON with ``dtype``, ``shape``, ``data_offsets`` and ``__metadata__``),
and ``safe_open`` reads them. The format has no streaming writer of its own, hence this one.

``StreamingCheckpoint`` writes into a directory no reader looks at (``runtime/checkpoint_series.py``
renames it into place once it is complete and fsynced), so a writer killed part-way leaves nothing that
looks like a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

HEADER_ALIGN = 8  # the header is padded with spaces so that the data starts 8-byte aligned
DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2)}


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bytes go: its file and the byte offset of its data there."""

    file: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str  # torch's name (float32, ...)


def file_layout(tensors: Mapping[str, tuple[tuple[int, ...], str]], metadata: Mapping[str, str]
                ) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A safetensors file's header (length prefix included) for ``tensors`` (name -> (shape, dtype)) in
    their order, and each tensor's (offset of its data from the file's start, byte count)."""
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    spans: dict[str, tuple[int, int]] = {}
    at = 0
    for name, (shape, dtype) in tensors.items():
        code, size = DTYPES[dtype]
        n = math.prod(shape) * size
        entries[name] = {"dtype": code, "shape": list(shape), "data_offsets": [at, at + n]}
        spans[name] = (at, n)
        at += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % HEADER_ALIGN)
    header = struct.pack("<Q", len(text)) + text
    return header, {k: (len(header) + a, n) for k, (a, n) in spans.items()}


class StreamingCheckpoint:
    """The files of one checkpoint, laid out before any tensor arrives; ``put`` writes one tensor at its
    offset and keeps nothing of it; ``close`` checks that every tensor came and fsyncs every file.

    ``files``: file name -> {tensor name: (shape, dtype)} in the file's order, and the file's metadata."""

    def __init__(self, directory: Path, files: Mapping[str, tuple[Mapping[str, tuple[tuple[int, ...], str]],
                                                                   Mapping[str, str]]]) -> None:
        self.directory = Path(directory)
        self.slots: dict[str, TensorSlot] = {}
        self._fds: dict[str, int] = {}
        self.missing: set[str] = set()
        try:
            for fname, (tensors, meta) in files.items():
                header, offsets = file_layout(tensors, meta)
                fd = os.open(self.directory / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fds[fname] = fd
                os.pwrite(fd, header, 0)
                end = len(header) + sum(n for _, n in offsets.values())
                os.ftruncate(fd, end)  # the file has its final size: a missing tensor reads as zeros, never short
                for name, (offset, n) in offsets.items():
                    shape, dtype = tensors[name]
                    self.slots[name] = TensorSlot(fname, offset, n, tuple(shape), dtype)
                    self.missing.add(name)
        except BaseException:
            self.abort()
            raise

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (on the CPU) at its slot. Raises on a name, shape or dtype the layout lacks."""
        slot = self.slots.get(name)
        if slot is None:
            raise KeyError(f"{name}: not a tensor of this checkpoint")
        if name not in self.missing:
            raise ValueError(f"{name}: written twice")
        got_dtype = str(tensor.dtype).removeprefix("torch.")
        if tuple(tensor.shape) != slot.shape or got_dtype != slot.dtype:
            raise ValueError(f"{name}: got {got_dtype} {list(tensor.shape)}, the layout has {slot.dtype} "
                             f"{list(slot.shape)}")
        import torch

        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        view = memoryview(flat.numpy())  # the tensor's own bytes: no copy
        fd, at, done = self._fds[slot.file], slot.offset, 0
        while done < slot.nbytes:  # pwrite may write less than asked (signals, large counts)
            done += os.pwrite(fd, view[done:], at + done)
        self.missing.discard(name)

    def close(self) -> list[Path]:
        """Fsync and close every file; the paths written. Refuses (and aborts) when a tensor never came."""
        if self.missing:
            names = sorted(self.missing)
            self.abort()
            raise RuntimeError(f"checkpoint incomplete: {len(names)} tensor(s) never arrived ({', '.join(names[:3])}"
                               f"{', ...' if len(names) > 3 else ''})")
        paths = []
        for fname, fd in self._fds.items():
            os.fsync(fd)
            os.close(fd)
            paths.append(self.directory / fname)
        self._fds.clear()
        return paths

    def abort(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """A small file written and fsynced (inside a directory that is renamed into place later)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
