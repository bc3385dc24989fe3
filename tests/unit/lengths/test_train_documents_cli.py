"""``hspmd train`` on documents refuses bad input before any worker starts: one line, exit 2, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner

from hetu_cli.main import cli
from runtime.launch.options import TrainOptions
from runtime.launch.session import documents_mode, run_devices, run_strategies
from runtime.torchfree.spec import load_plan_context

REPO = Path(__file__).resolve().parents[3]
PLAN = REPO / "tests" / "integration" / "engine_plans" / "lengths-two.yaml"
FIXED = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"


def refused(args: list[str]) -> str:
    res = CliRunner().invoke(cli, ["train", *args])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text('{"text": "hello"}\n\n{"text": oops}\n')
    line = refused(["--plan", str(PLAN), "--data", str(data)])
    assert f"{data}:3: malformed JSON" in line


def test_tokenizer_larger_than_the_model_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(300)}
    vocab["[UNK]"] = 300
    tok = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(tok))
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "t1 t2"}) + "\n")
    line = refused(["--plan", str(PLAN), "--data", str(data), "--tokenizer", str(tok)])
    assert f"{tok}: vocab_size: the tokenizer's vocabulary has 301 tokens, more than the model's vocab_size 256" \
        in line


def test_long_document_under_policy_error(tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "x" * 100}) + "\n")
    line = refused(["--plan", str(PLAN), "--data", str(data), "--long-documents", "error"])
    assert f"{data}:1: long_documents: a document of 100 tokens is longer than the maximum length 64" in line


def test_only_empty_documents_refused(tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text('{"text": ""}\n{"text": ""}\n')
    assert "no non-empty document (2 empty skipped)" in refused(["--plan", str(PLAN), "--data", str(data)])


def test_fixed_strategy_too_short_for_the_documents():
    line = refused(["--plan", str(PLAN), "--strategy", "short", "--lengths", "uniform"])
    assert "'short' serves documents up to 16 tokens, but the run's documents reach training.seq_len 64" in line


def test_uncovered_length_range_refused(tmp_path):
    data = yaml.safe_load(PLAN.read_text())
    data["strategies"][1]["max_seq_len"] = 32
    plan = tmp_path / "p.yaml"
    plan.write_text(yaml.safe_dump(data))
    line = refused(["--plan", str(plan), "--lengths", "uniform"])
    assert "strategies[1].max_seq_len: the strategies serve documents up to 32 tokens, leaving (32, 64]" in line


def test_unknown_distribution_and_flag_conflicts(tmp_path):
    assert "not both" in refused(["--plan", str(PLAN), "--lengths", "uniform", "--data", str(tmp_path / "x")])
    assert "--tokenizer" in refused(["--plan", str(PLAN), "--tokenizer", str(tmp_path / "t.json")])


def test_which_strategies_and_devices_a_run_uses(tmp_path):
    ctx = load_plan_context(PLAN)
    docs = TrainOptions(plan=PLAN, lengths="uniform")
    assert documents_mode(docs, ctx.plan.training)
    assert run_strategies(ctx, docs) == ("short", "long")
    assert run_strategies(ctx, TrainOptions(plan=PLAN, strategy="long")) == ("long",)
    assert run_devices(ctx, docs) == [0, 1, 2, 3]
    fixed = load_plan_context(FIXED)
    windows = TrainOptions(plan=FIXED, data_file=tmp_path / "a.txt")
    assert not documents_mode(windows, fixed.plan.training)          # plain text keeps the byte windows
    assert documents_mode(TrainOptions(plan=FIXED, data_file=tmp_path / "a.jsonl"), fixed.plan.training)
    assert run_strategies(fixed, windows) == (fixed.plan.strategies[0].name,)


def test_unknown_distribution():
    line = refused(["--plan", str(PLAN), "--lengths", "zipf"])
    assert line == "error: zipf: lengths: neither a known distribution (longtail, uniform, fixed) nor an existing file"


def test_start_up_line_counts_skipped_and_cut_documents(tmp_path):
    from runtime.launch.session import document_source_of, documents_line

    data = tmp_path / "c.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in ["", "abc", "", "x" * 150, "hello"]) + "\n")
    ctx = load_plan_context(PLAN)
    line = documents_line(document_source_of(ctx, TrainOptions(plan=PLAN, data_file=data)))
    # 150 bytes at a maximum of 64 split into 64 + 64 + 22: 5 documents from 3 non-empty lines
    assert line == (f"data: {data}: 5 documents after cutting (2 empty skipped, 1 split, 0 truncated; no EOS token "
                    "(bytes, or a tokenizer whose tokenizer_config.json names none)), 160 tokens per step, at most 64 "
                    "per document, epoch order")
