"""Document sources: long-tailed lengths, histograms, JSONL/text corpora, tokenizers, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.documents import (
    BYTE_VOCAB,
    ByteTokenizer,
    CorpusDocuments,
    HFTokenizer,
    LengthBin,
    LengthDistribution,
    SyntheticDocuments,
    data_format,
    document_source,
    fit_length,
    length_distribution,
    load_corpus,
    load_histogram,
    load_tokenizer,
    named_distribution,
    step_rng,
)
from runtime.torchfree.errors import SpecError

REPO = Path(__file__).resolve().parents[3]


def one_line(err: pytest.ExceptionInfo) -> str:
    lines = err.value.lines()
    assert len(lines) == 1, lines
    assert "\n" not in lines[0] and "Traceback" not in lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------- seeding


def test_step_rng_is_private_to_seed_step_and_stream():
    draws = [step_rng(7, 3, "lengths").random() for _ in range(2)]
    assert draws[0] == draws[1]
    others = {step_rng(8, 3, "lengths").random(), step_rng(7, 4, "lengths").random(),
              step_rng(7, 3, "tokens").random()}
    assert draws[0] not in others and len(others) == 3


# ---------------------------------------------------------------------------------------------- distributions


def test_longtail_scaled_to_paper_maximum():
    d = named_distribution("longtail", 32768)
    assert [(b.lo, b.hi) for b in d.bins] == [(1, 1024), (1025, 2048), (2049, 4096), (4097, 8192),
                                             (8193, 16384), (16385, 32768)]
    # the paper's trace: 97% of sequences shorter than 8K of 32K; some reach the maximum
    assert d.fraction_below(8193) == pytest.approx(0.97)
    assert d.fraction_below(32769) == pytest.approx(1.0)
    assert d.max_len == 32768
    rng = step_rng(0, 0, "check")
    sample = [d.sample(rng) for _ in range(20000)]
    assert 1 <= min(sample) and max(sample) <= 32768
    assert sum(s < 8192 for s in sample) / len(sample) == pytest.approx(0.97, abs=0.01)
    assert max(sample) > 16384


def test_named_distribution_scales_with_the_model():
    assert [(b.lo, b.hi) for b in named_distribution("longtail", 64).bins][:2] == [(1, 2), (3, 4)]
    assert [(b.lo, b.hi) for b in named_distribution("fixed", 100).bins] == [(100, 100)]
    assert [(b.lo, b.hi) for b in named_distribution("uniform", 100).bins] == [(1, 100)]
    with pytest.raises(SpecError) as err:
        length_distribution("zipf", 100)
    assert "zipf" in one_line(err) and "longtail" in one_line(err)


def test_histogram_tokens_and_fraction(tmp_path):
    f = tmp_path / "h.yaml"
    f.write_text("scale: tokens\nbins:\n  - {lo: 1, hi: 10, weight: 3}\n  - {lo: 11, hi: 20, weight: 1}\n")
    d = load_histogram(f, 100)
    assert d.fraction_below(11) == pytest.approx(0.75)
    rng = step_rng(1, 1, "x")
    assert all(1 <= d.sample(rng) <= 20 for _ in range(500))
    g = tmp_path / "g.yaml"
    g.write_text("scale: fraction\nbins:\n  - {lo: 0, hi: 0.5, weight: 1}\n  - {lo: 0.5, hi: 1, weight: 1}\n")
    assert [(b.lo, b.hi) for b in length_distribution(str(g), 200).bins] == [(1, 100), (101, 200)]


@pytest.mark.parametrize("text, expected", [
    ("bins: []\n", "h.yaml: bins: must be a non-empty list of {lo, hi, weight}"),
    ("bins:\n  - {lo: 5, hi: 2, weight: 1}\n", "h.yaml: bins[0].hi: must be an integer >= lo (5), got 2"),
    ("bins:\n  - {lo: 1, hi: 2, weight: -1}\n", "h.yaml: bins[0].weight: must be a finite number >= 0, got -1"),
    ("bins:\n  - {lo: 1, hi: 2, wieght: 1}\n", ["h.yaml: bins[0].wieght: unknown field; expected one of lo, hi, "
                                                 "weight", "h.yaml: bins[0].weight: missing"]),
    ("bins:\n  - {lo: 1, hi: 2, weight: 0}\n", "h.yaml: bins: the weights sum to 0; at least one bin needs a "
                                                "positive weight"),
    ("scale: bytes\nbins:\n  - {lo: 1, hi: 2, weight: 1}\n", "h.yaml: scale: must be tokens or fraction, got "
                                                             "'bytes'"),
    ("bins:\n  - {lo: 1, hi: 200, weight: 1}\n", "h.yaml: bins[0].hi: 200 is longer than the maximum length 100 "
                                                 "(policy error; use split or truncate)"),
])
def test_histogram_errors_name_file_and_field(tmp_path, text, expected):
    f = tmp_path / "h.yaml"
    f.write_text(text)
    with pytest.raises(SpecError) as err:
        load_histogram(f, 100, "error")
    expected = expected if isinstance(expected, list) else [expected]
    assert err.value.lines() == [f"{tmp_path}/{e}" for e in expected]


def test_long_document_policies():
    assert fit_length(10, 4, "split", "x") == (4, 4, 2)
    assert fit_length(8, 4, "split", "x") == (4, 4)
    assert fit_length(10, 4, "truncate", "x") == (4,)
    assert fit_length(3, 4, "error", "x") == (3,)
    with pytest.raises(SpecError) as err:
        fit_length(10, 4, "error", "a.jsonl:7")
    assert one_line(err) == ("a.jsonl:7: long_documents: a document of 10 tokens is longer than the maximum "
                             "length 4 (policy error; use split or truncate)")


# ---------------------------------------------------------------------------------------------- synthetic


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), step=st.integers(0, 10**6), budget=st.integers(1, 3000),
       max_len=st.integers(1, 700), name=st.sampled_from(["longtail", "uniform", "fixed"]))
def test_synthetic_deterministic_per_seed_and_step(seed, step, budget, max_len, name):
    dist = named_distribution(name, max_len)
    a = SyntheticDocuments(dist, budget, max_len, vocab_size=97, seed=seed)
    b = SyntheticDocuments(named_distribution(name, max_len), budget, max_len, vocab_size=97, seed=seed)
    docs = a.documents(step)
    assert docs == b.documents(step)
    assert docs.lengths == a.lengths(step)
    assert docs.num_tokens == budget
    assert all(1 <= n <= max_len for n in docs.lengths)
    for d in docs.documents:
        assert all(0 <= t < 97 for t in d.tokens)
        if len(d) >= 2:   # arithmetic mod vocab: learnable from two tokens of context
            stride = (d.tokens[1] - d.tokens[0]) % 97
            assert all((d.tokens[i + 1] - d.tokens[i]) % 97 == stride for i in range(len(d) - 1))


def test_synthetic_steps_differ_and_histogram_beyond_max_is_split(tmp_path):
    src = SyntheticDocuments(named_distribution("longtail", 4096), 50_000, 4096, 1000, seed=3)
    assert src.lengths(0) != src.lengths(1)
    f = tmp_path / "h.yaml"
    f.write_text("bins:\n  - {lo: 250, hi: 250, weight: 1}\n")
    split = SyntheticDocuments(load_histogram(f, 100), 1000, 100, 50, long_documents="split")
    assert split.lengths(0) == (100, 100, 50) * 4
    assert split.documents(0).split == 4
    cut = SyntheticDocuments(load_histogram(f, 100), 1000, 100, 50, long_documents="truncate")
    assert cut.lengths(0) == (100,) * 10 and cut.documents(0).truncated == 10


# ---------------------------------------------------------------------------------------------- corpora


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_bytes_empty_skipped_long_split(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}, {"text": ""}, "", {"text": "abcdefghij", "id": 3},
                                           {"text": "é"}])
    c = load_corpus(f, max_len=4, tokenizer=ByteTokenizer(), fmt="jsonl")
    assert c.documents == (tuple(b"hell"), (ord("o"),), tuple(b"abcd"), tuple(b"efgh"), tuple(b"ij"),
                           tuple("é".encode()))
    assert c.skipped_empty == 1 and c.split_documents == 2 and c.truncated_documents == 0
    assert c.origins[0] == f"{f}:1" and c.origins[2] == f"{f}:4"
    t = load_corpus(f, max_len=4, tokenizer=ByteTokenizer(), fmt="jsonl", long_documents="truncate")
    assert t.documents == (tuple(b"hell"), tuple(b"abcd"), tuple("é".encode())) and t.truncated_documents == 2
    with pytest.raises(SpecError) as err:
        load_corpus(f, max_len=4, tokenizer=ByteTokenizer(), fmt="jsonl", long_documents="error")
    assert one_line(err).startswith(f"{f}:1: long_documents: a document of 5 tokens")


@pytest.mark.parametrize("bad, expected", [
    ('{"text": "a",}', "malformed JSON: "),     # the json module's own wording varies between Pythons
    ('{"text": "a"', "malformed JSON: "),
    ('["text"]', "expected a JSON object, got list"),
    ('{"body": "x"}', "text: missing"),
    ('{"text": 5}', "text: expected a string, got int"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad, expected):
    f = write_jsonl(tmp_path / "c.jsonl", [{"text": "ok"}, {"text": "fine"}, bad, {"text": "never read"}])
    with pytest.raises(SpecError) as err:
        load_corpus(f, max_len=10, tokenizer=ByteTokenizer(), fmt="jsonl")
    line = one_line(err)
    if expected.endswith(": "):
        assert line.startswith(f"{f}:3: {expected}") and line.endswith(")") and "(column " in line
    else:
        assert line == f"{f}:3: {expected}"


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(SpecError) as err:
        load_corpus(tmp_path / "nope.jsonl", max_len=10, tokenizer=ByteTokenizer(), fmt="jsonl")
    assert one_line(err) == f"{tmp_path}/nope.jsonl: data: file not found"
    f = write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(SpecError) as err:
        load_corpus(f, max_len=10, tokenizer=ByteTokenizer(), fmt="jsonl")
    assert one_line(err) == f"{f}: data: no non-empty document (2 empty skipped)"


def test_text_file_documents_are_blank_line_separated_blocks(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"first line\nsecond\n\n   \nthird doc\n\n\nfourth\xff")
    c = load_corpus(f, max_len=100, tokenizer=ByteTokenizer(), fmt=data_format(f))
    assert c.documents == (tuple(b"first line\nsecond"), tuple(b"third doc"), tuple(b"fourth\xff"))
    assert c.origins == (f"{f}:1", f"{f}:5", f"{f}:8")
    assert data_format("x.JSONL") == "jsonl" and data_format("x.txt") == "text"


def tiny_tokenizer(path: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_hf_tokenizer_local_file(tmp_path):
    tj = tiny_tokenizer(tmp_path / "tokenizer.json", ["the", "cat", "sat"])
    tok = load_tokenizer(tj, model_vocab_size=8)
    assert tok.vocab_size == 4
    f = write_jsonl(tmp_path / "c.jsonl", [{"text": "the cat sat"}, {"text": "   "}, {"text": "dog the"}])
    c = load_corpus(f, max_len=10, tokenizer=tok, fmt="jsonl")
    assert c.documents == ((1, 2, 3), (0, 1))
    assert c.skipped_empty == 1           # whitespace only: no tokens
    t = tmp_path / "t.txt"
    t.write_text("the cat\n\nsat sat sat\n")
    assert load_corpus(t, max_len=2, tokenizer=tok, fmt="text").documents == ((1, 2), (3, 3), (3,))


def test_tokenizer_refusals(tmp_path):
    tj = tiny_tokenizer(tmp_path / "tokenizer.json", [f"w{i}" for i in range(20)])
    with pytest.raises(SpecError) as err:
        load_tokenizer(tj, model_vocab_size=16)
    assert one_line(err) == (f"{tj}: vocab_size: the tokenizer's vocabulary has 21 tokens, more than the model's "
                             f"vocab_size 16")
    with pytest.raises(SpecError) as err:
        load_tokenizer(None, model_vocab_size=100)
    assert one_line(err) == f"bytes: vocab_size: the tokenizer's vocabulary has {BYTE_VOCAB} tokens, more than " \
                            f"the model's vocab_size 100"
    junk = tmp_path / "junk.json"
    junk.write_text("not json")
    with pytest.raises(SpecError) as err:
        HFTokenizer(junk)
    assert one_line(err).startswith(f"{junk}: not a tokenizers tokenizer.json: ")
    with pytest.raises(SpecError) as err:
        HFTokenizer(tmp_path / "missing.json")
    assert one_line(err) == f"{tmp_path}/missing.json: file not found"


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), step=st.integers(1, 10**6), budget=st.integers(1, 400))
def test_corpus_steps_deterministic_and_exact_budget(tmp_path_factory, seed, step, budget):
    path = tmp_path_factory.getbasetemp() / "draws.jsonl"
    if not path.exists():
        write_jsonl(path, [{"text": "x" * n} for n in (1, 7, 30, 64, 3, 0, 50)])
    corpus = load_corpus(path, max_len=40, tokenizer=ByteTokenizer(), fmt="jsonl")
    src = CorpusDocuments(corpus, budget, 40, seed=seed)
    docs = src.documents(step)
    assert docs == CorpusDocuments(corpus, budget, 40, seed=seed).documents(step)
    assert docs.lengths == src.lengths(step) and docs.num_tokens == budget
    for d in docs.documents:   # parts of corpus documents; only the first and last may be cut (step boundaries)
        assert any(d.tokens == full[a:a + len(d)] for full in corpus.documents for a in range(len(full)))
    assert all(any(d.tokens == full for full in corpus.documents) for d in docs.documents[1:-1])


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 90), min_size=1, max_size=12), seed=st.integers(0, 2**31),
       budget=st.integers(1, 120))
def test_every_document_once_per_epoch(tmp_path_factory, lengths, seed, budget):
    """Two epochs' worth of steps, their documents joined back: each epoch is every document exactly once
    (in the order of its own permutation), and the second epoch's order differs from the first's unless the
    corpus is one document."""
    path = tmp_path_factory.mktemp("epoch") / "c.jsonl"
    texts = [chr(65 + i % 26) * n for i, n in enumerate(lengths)]   # each document its own letter and length
    write_jsonl(path, [{"text": t} for t in texts])
    if not any(texts):
        return
    corpus = load_corpus(path, max_len=40, tokenizer=ByteTokenizer(), fmt="jsonl")
    src = CorpusDocuments(corpus, budget, 40, seed=seed)
    total = sum(len(d) for d in corpus.documents)
    steps = -(-2 * total // budget)
    stream = [t for s in range(1, steps + 1) for d in src.documents(s).documents for t in d.tokens]
    for epoch in range(2):
        tokens = stream[epoch * total:(epoch + 1) * total]
        perm, _ = src.stream.order(epoch)
        assert tokens == [t for i in perm for t in corpus.documents[int(i)]]
        assert sorted(int(i) for i in perm) == list(range(len(corpus.documents)))


def test_sources_identical_across_processes(tmp_path):
    """Every rank computes the step's documents itself: another interpreter, another hash seed, same data."""
    code = ("import json,sys\n"
            "from runtime.documents import SyntheticDocuments, named_distribution\n"
            "s = SyntheticDocuments(named_distribution('longtail', 2048), 20000, 2048, 500, seed=11)\n"
            "out = [list(s.lengths(k)) for k in (0, 5, 99)] + [list(s.documents(7).documents[0].tokens)]\n"
            "assert 'torch' not in sys.modules, 'documents must stay torch-free'\n"
            "print(json.dumps(out))\n")
    outs = []
    for hash_seed in ("0", "4242"):
        env = {"PYTHONPATH": str(REPO), "PYTHONHASHSEED": hash_seed, "PATH": "/usr/bin:/bin"}
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True, cwd=REPO).stdout)
    s = SyntheticDocuments(named_distribution("longtail", 2048), 20000, 2048, 500, seed=11)
    here = [list(s.lengths(k)) for k in (0, 5, 99)] + [list(s.documents(7).documents[0].tokens)]
    assert json.loads(outs[0]) == json.loads(outs[1]) == here


def test_distribution_validation():
    with pytest.raises(ValueError):
        LengthDistribution("empty", ())


def test_document_source_selects_like_the_cli(tmp_path):
    syn = document_source(tokens_per_step=500, max_len=64, vocab_size=300, seed=2)
    assert isinstance(syn, SyntheticDocuments) and syn.distribution.name == "longtail"
    assert syn.documents(4).num_labels == 500 - len(syn.lengths(4))
    f = write_jsonl(tmp_path / "c.jsonl", [{"text": "abc"}, {"text": "de"}])
    src = document_source(tokens_per_step=10, max_len=64, vocab_size=300, data_file=f)
    assert isinstance(src, CorpusDocuments) and src.documents(1).num_tokens == 10
    with pytest.raises(SpecError) as err:
        document_source(tokens_per_step=10, max_len=64, vocab_size=100, data_file=f)
    assert "vocab_size" in one_line(err)


def test_sample_never_picks_a_zero_weight_bin():
    d = LengthDistribution("z", (LengthBin(1, 1, 0.0), LengthBin(2, 2, 1.0), LengthBin(3, 3, 0.0)))
    rng = step_rng(0, 0, "z")
    assert {d.sample(rng) for _ in range(200)} == {2}
