"""``hspmd data prepare``: token shards with EOS/BOS as the tokenizer config asks, read back in epoch order,
bounded memory on a corpus several times larger than the memory allowed, and one-line refusals."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.data import token_source
from runtime.documents import CorpusDocuments, document_source
from runtime.epochs import open_prepared
from runtime.token_shards import prepare_corpus
from runtime.torchfree.errors import HspmdError, SpecError

REPO = Path(__file__).resolve().parents[3]
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog"]
SPECIALS = ["[UNK]", "<s>", "</s>"]


def tokenizer(d: Path, config: dict | None = None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*SPECIALS, *WORDS])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d / "tokenizer.json"


def ids(text: str) -> list[int]:
    return [len(SPECIALS) + WORDS.index(w) for w in text.split()]


def corpus(path: Path, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(n)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def test_shards_hold_every_document_with_bos_and_eos(tmp_path):
    tok = tokenizer(tmp_path, {"eos_token": "</s>", "bos_token": {"content": "<s>"}, "add_bos_token": True})
    texts = corpus(tmp_path / "a.jsonl", 200)
    (tmp_path / "b.txt").write_text("the cat\nsat\n\n\n a dog \n")
    out = prepare_corpus([tmp_path / "a.jsonl", tmp_path / "b.txt"], tok, tmp_path / "out", shard_tokens=500)
    assert out.documents == 202 and out.shards > 2
    docs = open_prepared(tmp_path / "out")
    got = [docs.read(i, 0, int(n)).tolist() for i, n in enumerate(docs.lengths)]
    assert got == [[1, *ids(t), 2] for t in [*texts, "the cat sat", "a dog"]]
    assert docs.eos == 2 and docs.vocab_size == 10 and docs.tokens == out.tokens


def test_no_eos_is_refused_in_one_line_and_eos_names_it(tmp_path):
    tok = tokenizer(tmp_path)
    corpus(tmp_path / "a.jsonl", 3)
    with pytest.raises(SpecError, match="no EOS token: .*tokenizer_config.json names none; give --eos TOKEN"):
        prepare_corpus([tmp_path / "a.jsonl"], tok, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SpecError, match="--eos: '<eod>' is not a token"):
        prepare_corpus([tmp_path / "a.jsonl"], tok, tmp_path / "out", eos="<eod>")
    out = prepare_corpus([tmp_path / "a.jsonl"], tok, tmp_path / "out", eos="</s>")
    assert out.special.bos is None and open_prepared(out.directory).read(0, 0, 99).tolist()[-1] == 2
    with pytest.raises(HspmdError, match="exists; remove it or name another directory"):
        prepare_corpus([tmp_path / "a.jsonl"], tok, tmp_path / "out", eos="</s>")


def test_parquet_without_pyarrow_is_one_line(tmp_path):
    pytest.importorskip("tokenizers")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        tok = tokenizer(tmp_path, {"eos_token": "</s>"})
        (tmp_path / "c.parquet").write_bytes(b"PAR1")
        with pytest.raises(HspmdError, match="c.parquet: Parquet needs pyarrow, which is not installed"):
            prepare_corpus([tmp_path / "c.parquet"], tok, tmp_path / "out")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = tokenizer(tmp_path, {"eos_token": "</s>"})
    pq.write_table(pa.table({"text": ["the cat", "a dog sat"]}), tmp_path / "c.parquet")
    out = prepare_corpus([tmp_path / "c.parquet"], tok, tmp_path / "out")
    docs = open_prepared(out.directory)
    assert [docs.read(i, 0, 9).tolist() for i in range(2)] == [[*ids("the cat"), 2], [*ids("a dog sat"), 2]]


def test_training_reads_prepared_shards_in_epoch_order(tmp_path):
    """Packed documents over a prepared directory of several shards: one epoch's steps hold every document
    exactly once; windows read the same stream, consecutive rows sharing a token."""
    tok = tokenizer(tmp_path, {"eos_token": "</s>"})
    texts = corpus(tmp_path / "a.jsonl", 60, seed=3)
    prepare_corpus([tmp_path / "a.jsonl"], tok, tmp_path / "out", shard_tokens=200)
    src = document_source(tokens_per_step=37, max_len=64, vocab_size=16, seed=5, data_file=tmp_path / "out")
    assert isinstance(src, CorpusDocuments)
    total = src.stream.docs.tokens
    steps = -(-total // 37)
    stream = [t for s in range(1, steps + 1) for d in src.documents(s).documents for t in d.tokens][:total]
    perm, _ = src.stream.order(0)
    want = [[*ids(t), 2] for t in texts]
    assert stream == [t for i in perm for t in want[int(i)]]
    assert sorted(map(int, perm)) == list(range(len(texts)))
    assert src.position(steps)["epoch"] == 1

    windows = token_source(vocab_size=16, global_batch=3, seq_len=8, seed=5, data_file=tmp_path / "out")
    b1, b2 = windows.batch(1), windows.batch(2)
    flat = torch.tensor([t for i in perm for t in want[int(i)]])
    assert torch.equal(b1[:, :-1].reshape(-1), flat[:24]) and torch.equal(b2[0], flat[24:33])
    assert torch.equal(b1[1:, 0], b1[:-1, -1])


MEASURE = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def peak_rss(args: list[str]) -> int:
    out = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "hetu_cli", *args], cwd=REPO,
                         capture_output=True, text=True, check=True, timeout=300)
    return int(out.stdout.split()[-1])


def test_prepare_on_a_corpus_larger_than_its_memory_stays_within_it(tmp_path):
    """A 10 MB corpus under --max-memory 2MiB (about 5x): the process' peak resident memory exceeds that of the
    same command on a 256 KB corpus (imports, the tokenizer and its threads, a dozen batches) by less than the
    2 MiB allowed: memory does not grow with the corpus."""
    tok = tokenizer(tmp_path, {"eos_token": "</s>"})
    rng = random.Random(1)
    for name, size in (("big.jsonl", 10 * 2**20), ("small.jsonl", 2**18)):
        with open(tmp_path / name, "w") as f:
            while f.tell() < size:
                f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 400)))}) + "\n")
    allowed = 2 * 2**20
    assert (tmp_path / "big.jsonl").stat().st_size > 4 * allowed
    common = ["data", "prepare", "--tokenizer", str(tok), "--max-memory", "2MiB"]
    small = peak_rss([*common, str(tmp_path / "small.jsonl"), "-o", str(tmp_path / "s")])
    big = peak_rss([*common, str(tmp_path / "big.jsonl"), "-o", str(tmp_path / "b")])
    assert big - small < allowed, (big, small)
    docs = open_prepared(tmp_path / "b")
    assert docs.tokens > 2_000_000 and np.all(docs.lengths >= 2)
