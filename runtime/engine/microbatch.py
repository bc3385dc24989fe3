"""What one micro-batch feeds a stage: token ids, labels and, for packed documents, positions and document ids.

One object for both forms of data, so that a stage's forward has one input path: the fixed windows of
``global_batch x seq_len`` (``window_micro_batch``: each row one causal sequence, labels the next token) and
packed documents (``packed_micro_batch``: several whole documents back to back in one row, attention
block-diagonal causal, RoPE positions restarting per document, no label across a document boundary; packing
itself is runtime/documents.py ``pack``). A step's micro-batches, per pipeline, and its loss denominator form
a ``StepBatch``: every rank builds the same one from (seed, step) and the step's dispatch, so a receiving
stage knows the shape of every boundary tensor without a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.documents import IGNORE_INDEX, StepDocuments, pack


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """``tokens``/``labels`` [rows, seq] (labels ``IGNORE_INDEX`` where no loss is taken); ``positions`` and
    ``segments`` [rows, seq] for packed documents, None for plain causal rows."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    documents: tuple[int, ...] = ()  # packed: each document's length, in row order (what prices the block)

    def __post_init__(self) -> None:
        shape = tuple(self.tokens.shape)
        if len(shape) != 2:
            raise ValueError(f"micro-batch tokens must be [rows, seq], got {list(shape)}")
        for name in ("labels", "positions", "segments"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"micro-batch {name} has shape {list(t.shape)}, tokens {list(shape)}")
        if (self.positions is None) != (self.segments is None):
            raise ValueError("packed micro-batches need both positions and segments")

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, seq): with the hidden size, the shape of the boundary tensors this micro-batch sends."""
        rows, seq = self.tokens.shape
        return int(rows), int(seq)

    @property
    def num_labels(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device) -> MicroBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return MicroBatch(self.tokens.to(device), self.labels.to(device), move(self.positions), move(self.segments),
                          self.documents)


def window_micro_batch(rows: torch.Tensor) -> MicroBatch:
    """Fixed windows [samples, seq + 1]: inputs, and the same tokens shifted by one as labels."""
    return MicroBatch(rows[:, :-1], rows[:, 1:])


def packed_micro_batch(documents: Sequence[Sequence[int]]) -> MicroBatch:
    """Whole documents back to back in one unpadded row (``pack``'s varlen form)."""
    if not documents:
        raise ValueError("a packed micro-batch needs at least one document")
    (row,) = pack(documents).rows
    seg = row.segment_ids()

    def one(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).unsqueeze(0)

    return MicroBatch(one(row.tokens), one(row.labels), one(row.positions), one(seg),
                      tuple(len(d) for d in documents))


@dataclass(frozen=True, eq=False)
class StepBatch:
    """One step's data as a strategy runs it: per pipeline its micro-batches in schedule order (a pipeline may
    get none), and the step's loss denominator (labelled tokens over every pipeline)."""

    pipelines: tuple[tuple[MicroBatch, ...], ...]
    num_labels: int
    num_tokens: int

    def __post_init__(self) -> None:
        if self.num_labels < 0 or self.num_tokens < 0:
            raise ValueError("token counts must not be negative")


def documents_step_batch(docs: StepDocuments, layout: Sequence[Sequence[Sequence[int]]]) -> StepBatch:
    """The step's documents packed as dispatched: ``layout[p][j]`` lists the documents (indices into
    ``docs.documents``) of micro-batch j of pipeline p."""
    seen = sorted(d for pipe in layout for mb in pipe for d in mb)
    if seen != list(range(len(docs.documents))):
        raise ValueError("the layout must place every document of the step exactly once")
    pipelines = tuple(tuple(packed_micro_batch([docs.documents[d].tokens for d in mb]) for mb in pipe if mb)
                      for pipe in layout)
    return StepBatch(pipelines, docs.num_labels, docs.num_tokens)
