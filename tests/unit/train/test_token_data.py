"""runtime/data.py: every rank derives the same batch from (seed, step); byte files; clear errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.data import ByteTextTokens, SyntheticTokens, token_source
from runtime.torchfree.errors import HspmdError


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(8, 300), batch=st.integers(1, 6), seq=st.integers(2, 40), seed=st.integers(0, 2**31),
       step=st.integers(1, 10**6))
def test_synthetic_batches_are_pure_functions_of_seed_and_step(vocab, batch, seq, seed, step):
    src = SyntheticTokens(vocab, batch, seq, seed)
    x = src.batch(step)
    assert x.dtype == torch.long and tuple(x.shape) == (batch, seq + 1)
    assert int(x.min()) >= 0 and int(x.max()) < vocab
    assert torch.equal(x, SyntheticTokens(vocab, batch, seq, seed).batch(step))
    # Arithmetic sequences mod vocab: the same stride between every two neighbours of a row.
    d = (x[:, 1:] - x[:, :-1]) % vocab
    assert torch.equal(d, d[:, :1].expand_as(d))


def test_synthetic_steps_and_seeds_differ():
    a = SyntheticTokens(256, 8, 32, 0)
    assert not torch.equal(a.batch(1), a.batch(2))
    assert not torch.equal(a.batch(1), SyntheticTokens(256, 8, 32, 1).batch(1))


def test_byte_file_windows_come_from_the_file(tmp_path):
    text = ("The quick brown fox jumps over the lazy dog. " * 20).encode()
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    src = token_source(vocab_size=256, global_batch=5, seq_len=16, seed=3, data_file=path)
    assert isinstance(src, ByteTextTokens)
    x = src.batch(7)
    assert tuple(x.shape) == (5, 17) and x.dtype == torch.long
    for row in x.tolist():
        assert bytes(row) in text
    assert torch.equal(x, ByteTextTokens(path, 5, 16, 3).batch(7))
    assert not torch.equal(x, src.batch(8))


def test_a_file_of_exactly_one_sample_works(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"abcdefghi")
    x = ByteTextTokens(path, 3, 8, 0).batch(1)
    assert x.tolist() == [list(b"abcdefghi")] * 3


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "file not found"),
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.write_bytes(b""), "0 bytes, but a sample of seq_len 16 needs at least 17"),
    (lambda p: p.write_bytes(b"short"), "5 bytes, but a sample of seq_len 16 needs at least 17"),
])
def test_bad_data_files_are_one_line_user_errors(tmp_path, setup, message):
    path = tmp_path / "data.txt"
    setup(path)
    with pytest.raises(HspmdError) as err:
        token_source(vocab_size=256, global_batch=2, seq_len=16, seed=0, data_file=path)
    assert str(err.value).startswith(f"{path}: --data: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_byte_tokens_need_a_byte_vocabulary(tmp_path):
    path = tmp_path / "data.txt"
    path.write_bytes(b"x" * 100)
    with pytest.raises(HspmdError, match="vocabulary of at least 256, the model has 128"):
        token_source(vocab_size=128, global_batch=2, seq_len=16, seed=0, data_file=path)
