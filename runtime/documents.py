"""Training data as documents of varying length: a step's batch is a set of whole documents under a token
budget, packed into micro-batch rows whose attention and labels stay inside each document.

Why documents and not fixed windows: real corpora are long-tailed, and a plan that serves every step at the
longest length wastes compute on the short ones. The per-step dispatcher (``runtime.torchfree.dispatch``) needs the
step's document lengths; the model needs, per packed row, where each document starts (``cu_seqlens``),
positions that restart per document and labels that never cross a boundary. Both come from here, as plain
data (tuples of ints), so nothing here needs torch.

Determinism: every step's documents are a pure function of (seed, step), drawn from a ``random.Random``
seeded from a hash of (seed, step, stream) and read only through ``random()`` (the one method whose sequence
Python guarantees across versions). A run resumed at step k, or replayed, sees the same documents on every
rank. No global random state is touched.

Sources: ``SyntheticDocuments`` (lengths from a ``LengthDistribution``) and ``CorpusDocuments`` (a local
JSONL or text file's documents); ``document_source`` picks one as the CLI's options say.

A step holds exactly ``tokens_per_step`` tokens: documents are drawn until the budget is reached and the last
one is cut to the remaining budget (its tail is dropped), so every step trains the same number of tokens,
as the fixed ``global_batch x seq_len`` form does.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from runtime.data import BYTE_VOCAB, MAX_STRIDE
from runtime.epochs import EpochStream, TokenDocuments, in_memory, step_parts
from runtime.torchfree.errors import Checker, FieldErrors, Problem, SpecError
from runtime.torchfree.spec.io import is_dir, is_file, read_yaml
from runtime.torchfree.spec.schema import MAX_FLOAT

IGNORE_INDEX = -100          # the label of a document's last token and of padding (torch's cross_entropy default)

LongDocuments = Literal["split", "truncate", "error"]
LONG_DOCUMENT_POLICIES: tuple[str, ...] = ("split", "truncate", "error")
DataFormat = Literal["jsonl", "text"]


# ---------------------------------------------------------------------------------------------------------
# Seeded draws


def step_rng(seed: int, step: int, stream: str) -> random.Random:
    """A generator private to (seed, step, stream): independent of every other step and of global state."""
    digest = hashlib.blake2b(f"{seed}:{step}:{stream}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


def uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi] from one ``random()`` draw (``randint``'s algorithm may change between Pythons)."""
    return lo + min(int(rng.random() * (hi - lo + 1)), hi - lo)


# ---------------------------------------------------------------------------------------------------------
# Documents of a step


@dataclass(frozen=True)
class Document:
    """One document's tokens and where it came from (``FILE:LINE`` or ``synthetic``), for messages."""

    tokens: tuple[int, ...]
    origin: str

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError(f"{self.origin}: a document needs at least one token")

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class StepDocuments:
    """The documents of one step; ``split``/``truncated`` count drawn documents the long-document policy cut."""

    step: int
    documents: tuple[Document, ...]
    split: int = 0
    truncated: int = 0

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(len(d) for d in self.documents)

    @property
    def num_tokens(self) -> int:
        return sum(len(d) for d in self.documents)

    @property
    def num_labels(self) -> int:
        """Tokens that carry a loss (n - 1 per document): the step's loss is the sum over them / this."""
        return sum(len(d) - 1 for d in self.documents)


class DocumentSource(Protocol):
    tokens_per_step: int
    max_len: int

    def lengths(self, step: int) -> tuple[int, ...]:
        """The step's document lengths alone: what dispatch and the simulator need, without the tokens."""
        ...

    def documents(self, step: int) -> StepDocuments:
        ...

    def position(self, step: int) -> dict[str, object]:
        """Where the data stands once ``step`` is done (recorded in checkpoints, JSON-able)."""
        ...


def fit_length(length: int, max_len: int, policy: LongDocuments, origin: str) -> tuple[int, ...]:
    """The pieces a document of ``length`` tokens becomes under the long-document policy.

    ``split`` cuts it into consecutive pieces of ``max_len`` (the last shorter), each trained as its own
    document: no attention and no label across a cut. ``truncate`` keeps the first ``max_len`` tokens.
    """
    if length <= max_len:
        return (length,)
    if policy == "split":
        full, rest = divmod(length, max_len)
        return (max_len,) * full + ((rest,) if rest else ())
    if policy == "truncate":
        return (max_len,)
    raise SpecError([Problem(origin, "long_documents",
                             f"a document of {length} tokens is longer than the maximum length {max_len} "
                             f"(policy error; use split or truncate)")])


def check_policy(policy: str) -> None:
    if policy not in LONG_DOCUMENT_POLICIES:
        raise ValueError(f"long_documents: {policy!r} is not one of {', '.join(LONG_DOCUMENT_POLICIES)}")


class DrawFn(Protocol):
    def __call__(self, rng: random.Random) -> tuple[int, int]: ...


def draw_budget(rng: random.Random, tokens_per_step: int, draw: DrawFn) -> list[tuple[int, int]]:
    """Draw (item, length) until the budget is reached; the last length is cut to what the budget has left."""
    out: list[tuple[int, int]] = []
    left = tokens_per_step
    while left > 0:
        item, length = draw(rng)
        length = min(length, left)
        out.append((item, length))
        left -= length
    return out


# ---------------------------------------------------------------------------------------------------------
# Length distributions


@dataclass(frozen=True)
class LengthBin:
    """Lengths in [lo, hi] (inclusive, uniform within the bin), drawn with relative ``weight``."""

    lo: int
    hi: int
    weight: float

    def __post_init__(self) -> None:
        def integer(v: object) -> bool:   # a YAML ``true`` is no length
            return isinstance(v, int) and not isinstance(v, bool)

        with Checker() as c:
            c.check(integer(self.lo) and self.lo >= 1, "lo", f"must be an integer >= 1, got {self.lo!r}")
            c.check(integer(self.hi) and integer(self.lo) and self.hi >= self.lo, "hi",
                    f"must be an integer >= lo ({self.lo!r}), got {self.hi!r}")
            c.check(isinstance(self.weight, (int, float)) and not isinstance(self.weight, bool)
                    and math.isfinite(self.weight) and self.weight >= 0,
                    "weight", f"must be a finite number >= 0, got {self.weight!r}")


@dataclass(frozen=True)
class LengthDistribution:
    """A histogram of document lengths in tokens; ``sample`` maps two uniform draws to a length."""

    name: str
    bins: tuple[LengthBin, ...]
    cumulative: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        with Checker() as c:
            if not self.bins:
                c.add("bins", "needs at least one bin")
            total = sum(b.weight for b in self.bins)
            if self.bins and total <= 0:
                c.add("bins", "the weights sum to 0; at least one bin needs a positive weight")
        object.__setattr__(self, "cumulative", tuple(itertools.accumulate(b.weight / total for b in self.bins)))

    @property
    def max_len(self) -> int:
        return max(b.hi for b in self.bins if b.weight > 0)

    def sample(self, rng: random.Random) -> int:
        # bisect_right never lands on a zero-weight bin (its cumulative equals its predecessor's); only when
        # rounding leaves the last cumulative a hair below u does it run off the end: take the last real bin.
        i = bisect.bisect_right(self.cumulative, rng.random())
        if i >= len(self.bins):
            i = max(k for k, b in enumerate(self.bins) if b.weight > 0)
        b = self.bins[i]
        return uniform_int(rng, b.lo, b.hi)

    def fraction_below(self, length: int) -> float:
        """P(length < ``length``): the shape check the docs and tests quote (e.g. 97% below max/4)."""
        below = sum(b.weight * min(max(length - b.lo, 0), b.hi - b.lo + 1) / (b.hi - b.lo + 1) for b in self.bins)
        return below / sum(b.weight for b in self.bins)


# Built-in shapes as (lo, hi, weight) with lo/hi fractions of the maximum length. ``longtail`` is shaped like
# the HSPMD paper's trace (97% of sequences shorter than 8K of a 32K maximum): the mass falls by roughly 2.5x
# per doubling of length, like the log-normal-ish length histograms of web and code corpora, and 3% reaches
# from a quarter of the maximum up to the maximum itself, so most steps still hold at least one long document.
NAMED_DISTRIBUTIONS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "longtail": (
        (0.0, 1 / 32, 55.0),
        (1 / 32, 1 / 16, 20.0),
        (1 / 16, 1 / 8, 14.0),
        (1 / 8, 1 / 4, 8.0),
        (1 / 4, 1 / 2, 2.2),
        (1 / 2, 1.0, 0.8),
    ),
    "uniform": ((0.0, 1.0, 1.0),),
    "fixed": ((1.0, 1.0, 1.0),),
}
DEFAULT_DISTRIBUTION = "longtail"


def scale_fraction_bins(bins: Sequence[tuple[float, float, float]], max_len: int) -> tuple[LengthBin, ...]:
    """Fractions of the maximum to token bins: (lo, hi] becomes [floor(lo*max)+1, floor(hi*max)] (at least 1)."""
    out = []
    for lo, hi, w in bins:
        t_hi = max(1, math.floor(hi * max_len))
        t_lo = min(t_hi, math.floor(lo * max_len) + 1) if lo < hi else t_hi
        out.append(LengthBin(t_lo, t_hi, float(w)))
    return tuple(out)


def named_distribution(name: str, max_len: int) -> LengthDistribution:
    """A built-in shape scaled to the model's maximum length."""
    if name not in NAMED_DISTRIBUTIONS:
        raise SpecError([Problem("", "lengths", f"unknown distribution {name!r}; known: "
                                                f"{', '.join(NAMED_DISTRIBUTIONS)} (or a histogram YAML file)")])
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    return LengthDistribution(name, scale_fraction_bins(NAMED_DISTRIBUTIONS[name], max_len))


HISTOGRAM_KEYS = ("scale", "bins")
BIN_KEYS = ("lo", "hi", "weight")


def load_histogram(path: str | Path, max_len: int, policy: LongDocuments = "split") -> LengthDistribution:
    """A length histogram from YAML (format in docs/lengths.md): ``scale: tokens|fraction`` and ``bins``.

    With ``scale: fraction`` the bins are fractions of the model's maximum and scale with it. With
    ``scale: tokens`` a bin reaching beyond the maximum is refused here under policy ``error`` (rather than at
    some later step); under ``split``/``truncate`` its draws are cut like any long document.
    """
    check_policy(policy)
    file = str(path)
    data = read_yaml(path)
    problems: list[Problem] = []

    def bad(field_: str, msg: str) -> None:
        problems.append(Problem(file, field_, msg))

    if not isinstance(data, dict):
        raise SpecError([Problem(file, "", f"expected a mapping with {', '.join(HISTOGRAM_KEYS)}, "
                                           f"got {type(data).__name__}")])
    problems += [Problem(file, str(k), f"unknown field; expected one of {', '.join(HISTOGRAM_KEYS)}")
                 for k in data if k not in HISTOGRAM_KEYS]
    scale = data.get("scale", "tokens")
    if scale not in ("tokens", "fraction"):
        bad("scale", f"must be tokens or fraction, got {scale!r}")
    raw = data.get("bins")
    if not isinstance(raw, list) or not raw:
        bad("bins", "must be a non-empty list of {lo, hi, weight}")
        raise SpecError(problems)
    fraction_bins: list[tuple[float, float, float]] = []
    token_bins: list[LengthBin] = []
    for i, b in enumerate(raw):
        where = f"bins[{i}]"
        if not isinstance(b, dict):
            bad(where, f"expected a mapping with {', '.join(BIN_KEYS)}, got {type(b).__name__}")
            continue
        n = len(problems)
        problems += [Problem(file, f"{where}.{k}", f"unknown field; expected one of {', '.join(BIN_KEYS)}")
                     for k in b if k not in BIN_KEYS]
        problems += [Problem(file, f"{where}.{k}", "missing") for k in BIN_KEYS if k not in b]
        if len(problems) > n:
            continue
        # "not 0 <= w": nan too; math.isfinite(10**400) raised OverflowError (a traceback)
        lo, hi, w = b["lo"], b["hi"], b["weight"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= MAX_FLOAT:
            bad(f"{where}.weight", f"must be a finite number >= 0, got {w!r}")
            continue
        if scale == "fraction":
            ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi))
            if not ok or not 0 <= lo <= hi <= 1 or hi == 0:
                bad(where, f"fractions need 0 <= lo <= hi <= 1 and hi > 0, got lo {lo!r}, hi {hi!r}")
                continue
            fraction_bins.append((float(lo), float(hi), float(w)))
            continue
        try:
            token_bins.append(LengthBin(lo, hi, float(w)))
        except FieldErrors as exc:
            problems.extend(Problem(file, f"{where}.{f}", m) for f, m in exc.problems)
            continue
        if policy == "error" and hi > max_len and w > 0:
            bad(f"{where}.hi", f"{hi} is longer than the maximum length {max_len} (policy error; use split "
                               f"or truncate)")
    if problems:
        raise SpecError(problems)
    bins = scale_fraction_bins(fraction_bins, max_len) if scale == "fraction" else tuple(token_bins)
    try:
        return LengthDistribution(Path(path).name, bins)
    except FieldErrors as exc:
        raise SpecError([Problem(file, f, m) for f, m in exc.problems]) from None


def length_distribution(spec: str, max_len: int, policy: LongDocuments = "split") -> LengthDistribution:
    """``spec`` is a built-in name, or else the path of a histogram YAML file (what ``--lengths`` takes)."""
    if spec in NAMED_DISTRIBUTIONS:
        return named_distribution(spec, max_len)
    if not os.path.exists(spec):   # (False, not an OSError, for names no file can have: too long)
        raise SpecError([Problem(spec, "lengths", f"neither a known distribution "
                                                  f"({', '.join(NAMED_DISTRIBUTIONS)}) nor an existing file")])
    return load_histogram(spec, max_len, policy)


@dataclass(frozen=True)
class SyntheticDocuments:
    """Documents with lengths from ``distribution``; tokens ``(start + stride * i) mod vocab`` per document,
    learnable from two tokens of context, so a packed run's loss visibly falls."""

    distribution: LengthDistribution
    tokens_per_step: int
    max_len: int
    vocab_size: int
    seed: int = 0
    long_documents: LongDocuments = "split"

    def __post_init__(self) -> None:
        with Checker() as c:
            c.each(self, ("tokens_per_step", "max_len", "vocab_size"), lambda v: v >= 1, "must be >= 1")
            c.check(self.long_documents in LONG_DOCUMENT_POLICIES, "long_documents",
                    f"must be one of {', '.join(LONG_DOCUMENT_POLICIES)}, got {self.long_documents!r}")

    def _pieces(self, step: int) -> tuple[list[int], int, int]:
        rng = step_rng(self.seed, step, "lengths")
        lengths: list[int] = []
        split = truncated = 0
        left = self.tokens_per_step
        while left > 0:
            drawn = self.distribution.sample(rng)
            # Split pieces past the step's tokens are dropped: cutting only what the step can take keeps a
            # histogram of huge documents (10**30 tokens) from building pieces no step holds.
            cut = min(drawn, left + self.max_len) if self.long_documents == "split" else drawn
            pieces = fit_length(cut, self.max_len, self.long_documents, f"{self.distribution.name}: step {step}")
            split += len(pieces) > 1
            truncated += self.long_documents == "truncate" and drawn > self.max_len
            for p in pieces:
                if left <= 0:
                    break
                lengths.append(min(p, left))
                left -= lengths[-1]
        return lengths, split, truncated

    def lengths(self, step: int) -> tuple[int, ...]:
        return tuple(self._pieces(step)[0])

    def position(self, step: int) -> dict[str, object]:
        return {"source": "synthetic-documents", "step": step}

    def documents(self, step: int) -> StepDocuments:
        lengths, split, truncated = self._pieces(step)
        rng = step_rng(self.seed, step, "tokens")
        docs = []
        v = self.vocab_size
        for n in lengths:
            start = uniform_int(rng, 0, v - 1)
            stride = uniform_int(rng, 1, MAX_STRIDE)
            docs.append(Document(tuple((start + stride * i) % v for i in range(n)), "synthetic"))
        return StepDocuments(step, tuple(docs), split, truncated)


# ---------------------------------------------------------------------------------------------------------
# Tokenizers and corpora


class Tokenizer(Protocol):
    vocab_size: int
    origin: str

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256): needs no file and no download."""

    vocab_size: int = BYTE_VOCAB
    origin: str = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` through the ``tokenizers`` library; nothing is downloaded.

    Special tokens are not added: a document is its text, and the packing marks its boundaries.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTok  # here: byte-level runs need not import it

        self.origin = str(path)
        p = Path(path)
        if not is_file(p):
            what = "is a directory, expected a tokenizer.json" if is_dir(p) else "file not found"
            raise SpecError([Problem(self.origin, "", what)])
        try:
            self._tok = HFTok.from_file(str(p))
        except Exception as exc:  # the library raises a bare Exception for malformed files
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise SpecError([Problem(self.origin, "", f"not a tokenizers tokenizer.json: {first}")]) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self):  # -> tokenizers.Tokenizer
        """The ``tokenizers`` object (batch encoding, special tokens)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def load_tokenizer(path: str | Path | None, model_vocab_size: int) -> Tokenizer:
    """Bytes (``path`` None) or a local tokenizer.json, refused when its ids would not fit the model."""
    tok: Tokenizer = ByteTokenizer() if path is None else HFTokenizer(path)
    if tok.vocab_size > model_vocab_size:
        raise SpecError([Problem(tok.origin, "vocab_size",
                                 f"the tokenizer's vocabulary has {tok.vocab_size} tokens, more than the "
                                 f"model's vocab_size {model_vocab_size}")])
    return tok


def data_format(path: str | Path) -> DataFormat:
    """The CLI's convention: ``*.jsonl`` is JSON Lines, anything else plain text."""
    return "jsonl" if Path(path).suffix.lower() == ".jsonl" else "text"


@dataclass(frozen=True)
class Corpus:
    """A file's documents, tokenized and cut to the maximum length once, at load, so that every error
    (malformed line, document too long under policy error) surfaces before the first step."""

    path: str
    documents: tuple[tuple[int, ...], ...]
    origins: tuple[str, ...]
    pieces: tuple[bool, ...]          # per entry: produced by the split policy
    cut: tuple[bool, ...]             # per entry: produced by the truncate policy
    skipped_empty: int                # documents with no tokens: never drawn, counted for the report
    split_documents: int
    truncated_documents: int
    eos: int | None = None            # the EOS appended to every document (None: none; bytes have no EOS)


def read_jsonl(path: Path) -> list[tuple[str, str]]:
    """(origin ``FILE:LINE``, text) per non-blank line; a bad line is an error naming ``FILE:LINE``."""
    return list(iter_jsonl(path))


def iter_jsonl(path: Path) -> Iterator[tuple[str, str]]:
    """``read_jsonl`` one line at a time (corpora larger than memory)."""
    with open_data(path) as f:
        for n, raw in enumerate(f, start=1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SpecError([Problem(where, "", f"not UTF-8 (byte {exc.start})")]) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecError([Problem(where, "", f"malformed JSON: {exc.msg} (column {exc.colno})")]) from None
            if not isinstance(obj, dict):
                raise SpecError([Problem(where, "", f"expected a JSON object, got {type(obj).__name__}")])
            if "text" not in obj:
                raise SpecError([Problem(where, "text", "missing")])
            if not isinstance(obj["text"], str):
                raise SpecError([Problem(where, "text", f"expected a string, got {type(obj['text']).__name__}")])
            try:   # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer can encode
                obj["text"].encode("utf-8")
            except UnicodeEncodeError as exc:
                raise SpecError([Problem(where, "text", f"not valid Unicode: a lone surrogate at character "
                                                        f"{exc.start}")]) from None
            yield where, obj["text"]


def read_text_blocks(path: Path) -> list[tuple[str, bytes]]:
    """A plain text file's documents: blocks of lines separated by blank (whitespace-only) lines."""
    return list(iter_text_blocks(path))


def iter_text_blocks(path: Path) -> Iterator[tuple[str, bytes]]:
    """``read_text_blocks`` one block at a time."""
    with open_data(path) as f:
        lines = enumerate(f, start=1)
        for text, group in itertools.groupby(lines, key=lambda x: bool(x[1].strip())):
            if text:
                block = list(group)
                yield f"{path}:{block[0][0]}", b"".join(raw for _, raw in block).rstrip(b"\r\n")


def open_data(path: Path):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise SpecError([Problem(str(path), "data", "file not found")]) from None
    except IsADirectoryError:
        raise SpecError([Problem(str(path), "data", "is a directory, expected a JSONL or text file")]) from None
    except OSError as exc:
        raise SpecError([Problem(str(path), "data", f"cannot read: {exc.strerror or exc}")]) from None


def load_corpus(path: str | Path, *, max_len: int, tokenizer: Tokenizer, fmt: DataFormat,
                long_documents: LongDocuments = "split", eos: int | None = None) -> Corpus:
    """Read, tokenize and cut every document of ``path`` (``eos`` appended to each non-empty one first);
    refuse a file with no non-empty document."""
    check_policy(long_documents)
    p = Path(path)
    if fmt == "jsonl":
        texts = [(where, tokenizer.encode(text)) for where, text in read_jsonl(p)]
    elif fmt == "text":
        texts = []
        for where, raw in read_text_blocks(p):
            if isinstance(tokenizer, ByteTokenizer):
                texts.append((where, list(raw)))
                continue
            try:
                texts.append((where, tokenizer.encode(raw.decode("utf-8"))))
            except UnicodeDecodeError as exc:
                raise SpecError([Problem(where, "", f"not UTF-8 (byte {exc.start} of the document)")]) from None
    else:
        raise ValueError(f"fmt must be jsonl or text, got {fmt!r}")
    docs: list[tuple[int, ...]] = []
    origins: list[str] = []
    pieces: list[bool] = []
    cut: list[bool] = []
    empty = split = truncated = 0
    for where, ids in texts:
        if not ids:
            empty += 1
            continue
        if eos is not None:
            ids = [*ids, eos]
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise SpecError([Problem(where, "", f"token id {bad[0]} outside the tokenizer's vocabulary "
                                                f"{tokenizer.vocab_size}")])
        parts = fit_length(len(ids), max_len, long_documents, where)
        was_split, was_cut = len(parts) > 1, len(ids) > max_len and long_documents == "truncate"
        split += was_split
        truncated += was_cut
        for offset, n in zip(itertools.accumulate(parts, initial=0), parts):
            docs.append(tuple(ids[offset:offset + n]))
            origins.append(where)
            pieces.append(was_split)
            cut.append(was_cut)
    if not docs:
        raise SpecError([Problem(str(p), "data", f"no non-empty document ({empty} empty skipped)")])
    return Corpus(str(p), tuple(docs), tuple(origins), tuple(pieces), tuple(cut), empty, split, truncated, eos)


@dataclass(frozen=True)
class CorpusDocuments:
    """A corpus' documents in epoch order (runtime/epochs.py): every document once per epoch, each epoch
    shuffled by (seed, epoch); step ``s`` holds the ``tokens_per_step`` tokens from ``(s - 1) *
    tokens_per_step`` of the epochs' stream, so the first and last of its documents may be parts (a
    document cut by a step boundary trains as two, one per step). A pure function of (seed, step).

    ``corpus``: a small file's documents (held in memory), or None with ``prepared``: a ``hspmd data
    prepare`` directory's memory-mapped shards."""

    corpus: Corpus | None
    tokens_per_step: int
    max_len: int
    seed: int = 0
    prepared: TokenDocuments | None = None
    stream: EpochStream = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(self.tokens_per_step >= 1, "tokens_per_step", f"must be >= 1, got {self.tokens_per_step}")
            c.check((self.corpus is None) != (self.prepared is None), "corpus", "give a corpus or prepared shards")
            if self.corpus is not None:
                c.check(self.max_len >= max(len(d) for d in self.corpus.documents), "max_len",
                        f"{self.max_len} is shorter than the corpus' longest document; load it with this max_len")
        docs = self.prepared if self.prepared is not None else in_memory(self.corpus.documents, self.corpus.path)
        object.__setattr__(self, "stream", EpochStream(docs, self.seed))

    @property
    def origin(self) -> str:
        return self.stream.docs.origin

    def lengths(self, step: int) -> tuple[int, ...]:
        return tuple(b - a for _, _, a, b in step_parts(self.stream, self.tokens_per_step, self.max_len, step))

    def documents(self, step: int) -> StepDocuments:
        parts = step_parts(self.stream, self.tokens_per_step, self.max_len, step)
        c = self.corpus
        docs = []
        for _epoch, i, a, b in parts:
            where = c.origins[i] if c is not None else f"{self.origin}: document {i}"
            docs.append(Document(tuple(int(t) for t in self.stream.docs.read(i, a, b)), where))
        split = sum(c.pieces[i] for _, i, _, _ in parts) if c is not None else 0
        cut = sum(c.cut[i] for _, i, _, _ in parts) if c is not None else 0
        return StepDocuments(step, tuple(docs), split, cut)

    def position(self, step: int) -> dict[str, object]:
        return {"source": self.origin, "step": step, **self.stream.position(step * self.tokens_per_step)}


# ---------------------------------------------------------------------------------------------------------
# Packing


@dataclass(frozen=True)
class PackedRow:
    """One micro-batch row holding several whole documents back to back, then padding.

    ``cu_seqlens`` are the document boundaries (0, l1, l1+l2, ..., used): token t belongs to document i when
    cu_seqlens[i] <= t < cu_seqlens[i+1]; a block-diagonal causal mask lets t attend to u iff both lie in the
    same document and u <= t. ``positions`` restart at 0 in each document (RoPE). ``labels[t]`` is the next
    token of t's own document, ``IGNORE_INDEX`` at each document's last token and in the padding.
    """

    tokens: tuple[int, ...]
    labels: tuple[int, ...]
    positions: tuple[int, ...]
    cu_seqlens: tuple[int, ...]
    documents: tuple[int, ...]        # indices into pack()'s input, in row order

    @property
    def used(self) -> int:
        return self.cu_seqlens[-1]

    def segment_ids(self) -> tuple[int, ...]:
        """Per token the row-local document number, -1 for padding (one form of the block-diagonal mask)."""
        seg = [i for i, (a, b) in enumerate(itertools.pairwise(self.cu_seqlens)) for _ in range(a, b)]
        return tuple(seg + [-1] * (len(self.tokens) - len(seg)))


@dataclass(frozen=True)
class PackedBatch:
    rows: tuple[PackedRow, ...]
    row_len: int

    @property
    def num_tokens(self) -> int:
        return sum(r.used for r in self.rows)

    @property
    def num_labels(self) -> int:
        """Tokens that carry a loss: each document of n tokens gives n - 1."""
        return sum(1 for r in self.rows for x in r.labels if x != IGNORE_INDEX)

    @property
    def padding(self) -> int:
        return len(self.rows) * self.row_len - self.num_tokens


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Document indices per row: first-fit decreasing (ties by index), so equal input packs identically."""
    if row_len < 1:
        raise ValueError(f"row_len must be >= 1, got {row_len}")
    for i, n in enumerate(lengths):
        if not 1 <= n <= row_len:
            raise ValueError(f"document {i}: length {n} outside 1..row_len {row_len}")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, left in enumerate(free):
            if lengths[i] <= left:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(row_len - lengths[i])
    return rows


def pack(documents: Sequence[Sequence[int]], row_len: int | None = None, pad_id: int = 0) -> PackedBatch:
    """Pack whole documents into rows of ``row_len`` tokens (first-fit decreasing), or, with ``row_len``
    None, into one unpadded row in input order (the varlen form). No document is ever split across rows."""
    lengths = [len(d) for d in documents]
    if row_len is None:
        layout = [list(range(len(documents)))] if documents else []
        width = sum(lengths)
    else:
        layout = pack_rows(lengths, row_len)
        width = row_len
    rows = []
    for members in layout:
        tokens: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        cu = [0]
        for i in members:
            doc = list(documents[i])
            if not doc:
                raise ValueError(f"document {i} is empty")
            tokens += doc
            labels += doc[1:] + [IGNORE_INDEX]
            positions += range(len(doc))
            cu.append(cu[-1] + len(doc))
        pad = width - len(tokens)
        rows.append(PackedRow(tuple(tokens + [pad_id] * pad), tuple(labels + [IGNORE_INDEX] * pad),
                              tuple(positions + [0] * pad), tuple(cu), tuple(members)))
    return PackedBatch(tuple(rows), width)


def document_source(*, tokens_per_step: int, max_len: int, vocab_size: int, seed: int = 0,
                    data_file: str | Path | None = None, tokenizer: str | Path | None = None,
                    lengths: str = DEFAULT_DISTRIBUTION, long_documents: LongDocuments = "split") -> DocumentSource:
    """What the CLI's ``--data/--tokenizer/--lengths/--long-documents`` select: a file's documents (JSONL by
    its ``.jsonl`` suffix, else plain text; bytes unless a tokenizer.json is given), or else the synthetic
    stream with lengths from a built-in distribution or a histogram file, scaled to ``max_len``."""
    check_policy(long_documents)
    if data_file is None:
        dist = length_distribution(lengths, max_len, long_documents)
        return SyntheticDocuments(dist, tokens_per_step, max_len, vocab_size, seed, long_documents)
    if is_dir(Path(data_file)):
        return prepared_source(Path(data_file), tokens_per_step=tokens_per_step, max_len=max_len,
                               vocab_size=vocab_size, seed=seed, long_documents=long_documents)
    tok = load_tokenizer(tokenizer, vocab_size)
    eos = None
    if isinstance(tok, HFTokenizer):
        from runtime.torchfree.special_tokens import special_tokens

        eos = special_tokens(Path(tokenizer), tok.backend, require_eos=False).eos  # type: ignore[arg-type]
    corpus = load_corpus(data_file, max_len=max_len, tokenizer=tok, fmt=data_format(data_file),
                         long_documents=long_documents, eos=eos)
    return CorpusDocuments(corpus, tokens_per_step, max_len, seed)


def prepared_source(directory: Path, *, tokens_per_step: int, max_len: int, vocab_size: int, seed: int,
                    long_documents: LongDocuments) -> CorpusDocuments:
    """A ``hspmd data prepare`` directory as packed documents, the long-document policy applied."""
    from runtime.epochs import open_prepared

    docs = open_prepared(directory)
    if docs.vocab_size > vocab_size:
        raise SpecError([Problem(str(directory), "vocab_size", f"its tokens come from a vocabulary of "
                                                               f"{docs.vocab_size}, more than the model's "
                                                               f"{vocab_size}")])
    longest = int(docs.lengths.max()) if len(docs.lengths) else 0
    if longest > max_len and long_documents == "error":
        raise SpecError([Problem(str(directory), "long_documents", f"a document of {longest} tokens is longer than "
                                                                   f"the maximum length {max_len} (policy error; "
                                                                   "use split or truncate)")])
    if long_documents == "truncate":
        docs = docs.clipped(max_len)
    return CorpusDocuments(None, tokens_per_step, max_len, seed, prepared=docs)
