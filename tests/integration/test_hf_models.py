"""Hugging Face models in and out, on heterogeneous plans (TP + uneven pipelines), against transformers.

* hspmd trains a tiny Llama (Llama 3 rope scaling), Qwen2 (q/k/v bias) and a tied-embedding model on a
  plan whose first stage is TP-2 and whose last stage is TP-1 (the tied weight is held by both: split in
  two on the first, whole on the last); the run equals the single-device reference, and the ``--save``
  directory opens with ``AutoModelForCausalLM.from_pretrained`` with logits equal to hspmd's forward;
* a checkpoint written by transformers (``save_pretrained``) loads into hspmd under two different plans,
  and the first step's loss is transformers' loss on the same batch.

One 4-process gloo world serves the module (engine_world.py); configs are built here, nothing is
downloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_world import EngineWorld
from test_engine_correctness import assemble, check_against_reference

from runtime.checkpoint import OPTIMIZER_FILE, WEIGHTS_FILE, latest_checkpoint, read_saved
from runtime.data import token_source
from runtime.engine.reference import ReferenceTrainer
from runtime.launch import TrainOptions, launch
from runtime.models.llama import LlamaForCausalLM
from runtime.torchfree.spec import load_plan_context

transformers = pytest.importorskip("transformers")

CLUSTER = Path(__file__).parent / "engine_plans" / "cpu-emu8.yaml"
SEQ = 8
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# TP-2 first stage (embedding, layer 0), TP-1 last stage (layers 1-2, head): uneven, TP changes across it.
HETERO = [(4, [([0, 1], (0, 1)), ([2], (1, 3))])]
# Another plan for loading: a three-stage TP-1 pipeline beside a TP-2 single-stage pipeline.
OTHER = [(3, [([0], (0, 1)), ([1], (1, 2)), ([2], (2, 3))]), (1, [([3, 4], (0, 3))])]


@pytest.fixture(scope="module")
def world():
    w = EngineWorld(5)
    yield w
    w.close()


def hf_dir(tmp_path: Path, name: str, config) -> Path:
    """A tiny random model saved by transformers (weights and config.json)."""
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    path = tmp_path / name
    model.save_pretrained(path)
    return path


def config_dir(tmp_path: Path, name: str, config) -> Path:
    """A model directory holding only config.json (hspmd initialises the weights)."""
    path = tmp_path / name
    config.save_pretrained(path)
    return path


def write_plan(path: Path, model: Path, pipelines, *, micro_batch: int = 1) -> Path:
    lines = ["version: 1", f"model: {model}", f"cluster: {CLUSTER}", "training:",
             f"  global_batch: {sum(m for m, _ in pipelines) * micro_batch}", f"  micro_batch: {micro_batch}",
             f"  seq_len: {SEQ}", "  schedule: 1f1b", "  seed: 7",
             "  optimizer: {lr: 0.001, weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1.0e-05, grad_clip: 1.0}",
             "strategies:", "- name: s", "  pipelines:"]
    for mbs, stages in pipelines:
        lines += [f"  - micro_batches: {mbs}", "    stages:"]
        lines += [f"    - {{devices: {list(d)}, layers: [{a}, {b}]}}" for d, (a, b) in stages]
    path.write_text("\n".join(lines) + "\n")
    return path


def batches(vocab: int, global_batch: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (global_batch, SEQ + 1), generator=g) for _ in range(n)]


def hspmd_logits(ctx, params: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    module = LlamaForCausalLM(ctx.model)
    module.load_state_dict(params | ({"lm_head.weight": params["model.embed_tokens.weight"]}
                                     if ctx.model.tie_word_embeddings else {}))
    with torch.no_grad():
        return module(tokens)


def hf_logits(path: Path, tokens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


MODELS = {
    "llama3-rope": lambda: transformers.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "qwen2-bias": lambda: transformers.Qwen2Config(**TINY, rope_theta=1e6),
    "llama-tied": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=True),
}


# Each model on the hetero plan; the tied one also where one TP-2 stage does both the lookup and the head.
CASES = [(kind, "hetero") for kind in MODELS] + [("llama-tied", "other")]


@pytest.mark.parametrize("kind,plan_name", CASES, ids=[f"{k}-{p}" for k, p in CASES])
def test_trained_on_a_hetero_plan_saved_and_opened_by_transformers(world, tmp_path: Path, kind: str,
                                                                   plan_name: str) -> None:
    model_dir = config_dir(tmp_path, kind, MODELS[kind]())
    plan = write_plan(tmp_path / "plan.yaml", model_dir, HETERO if plan_name == "hetero" else OTHER)
    ctx = load_plan_context(plan)
    assert ctx.model.family == ("qwen2" if kind.startswith("qwen") else "llama")
    steps = batches(ctx.model.vocab_size, ctx.plan.training.global_batch, 3)
    save = tmp_path / "ck"
    results = world.train(str(plan), steps, save_dir=str(save))
    # The plan trains with the single-device reference's numbers (losses, norms, parameters, moments).
    check_against_reference(plan, results, steps)
    if ctx.model.tie_word_embeddings and plan_name == "hetero":  # whole on device 2, split over 0 and 1
        assert "lm_head.weight" not in results[2].regions
        assert results[2].regions["model.embed_tokens.weight"] == ((0, 64), (0, 32))
        assert results[1].regions["model.embed_tokens.weight"] == ((32, 64), (0, 32))
    params = {n: assemble(results, n, n, info) for n, info in
              ((n, tuple(t.shape)) for n, t in ReferenceTrainer(ctx.model, ctx.plan.training).parameters().items())}
    assert {p.name for p in save.iterdir()} == {"config.json", WEIGHTS_FILE, OPTIMIZER_FILE}
    saved, meta = read_saved(save)
    assert meta["step"] == "3"
    for name, p in params.items():
        assert torch.equal(saved[name], p), name
    tokens = steps[0][:, :-1]
    ours, theirs = hspmd_logits(ctx, params, tokens), hf_logits(save, tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def test_a_transformers_checkpoint_loads_under_two_plans(world, tmp_path: Path) -> None:
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    pretrained = hf_dir(tmp_path, "pretrained", config)
    # The second plan also shards the (zero) moments with ZeRO-1 over its two pipelines.
    for name, pipelines, zero in (("hetero", HETERO, False), ("other", OTHER, True)):
        plan = write_plan(tmp_path / f"{name}.yaml", pretrained, pipelines)
        ctx = load_plan_context(plan)
        batch = batches(ctx.model.vocab_size, ctx.plan.training.global_batch, 1)
        results = world.train(str(plan), batch, zero=zero, load_dir=str(pretrained))
        assert any(r.moment_pieces for r in results.values()) == zero
        model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).eval()
        with torch.no_grad():
            want = model(batch[0], labels=batch[0]).loss.item()
        for dev, r in results.items():
            assert r.losses[0] == pytest.approx(want, rel=1e-5), (name, dev)


def test_cli_path_trains_from_pretrained_weights_and_transformers_opens_the_result(tmp_path: Path) -> None:
    """What a user runs (hspmd train --load PRETRAINED --save OUT), through the launcher's own workers;
    the plan names the model directory by its bare name, beside the plan."""
    pretrained = hf_dir(tmp_path, "pretrained", MODELS["llama3-rope"]())
    (pretrained / "tokenizer.json").write_text('{"version": "1.0"}')
    (pretrained / "generation_config.json").write_text('{"max_new_tokens": 8}')
    plan = write_plan(tmp_path / "plan.yaml", Path("pretrained"), HETERO)
    ctx = load_plan_context(plan)
    out = tmp_path / "tuned"
    run = launch(TrainOptions(plan=plan, steps=2, load_dir=pretrained, save_dir=out))
    t = ctx.plan.training
    first = token_source(vocab_size=ctx.model.vocab_size, global_batch=t.global_batch, seq_len=t.seq_len,
                         seed=t.seed).batch(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).eval()
    with torch.no_grad():
        assert run.records[0].loss == pytest.approx(model(first, labels=first).loss.item(), rel=1e-5)
    saved, meta = read_saved(out)
    assert meta["step"] == "2"
    for name in ("tokenizer.json", "generation_config.json"):   # carried along: the result is usable as it is
        assert (latest_checkpoint(out) / name).read_text() == (pretrained / name).read_text()
    params = {k: v for k, v in saved.items() if not k.endswith(("exp_avg", "exp_avg_sq"))}
    tokens = first[:, :-1]
    assert latest_checkpoint(out) == out / "step-00000002"   # --save writes step checkpoints, each one HF directory
    torch.testing.assert_close(hf_logits(latest_checkpoint(out), tokens), hspmd_logits(ctx, params, tokens), rtol=1e-5,
                               atol=1e-6)
    assert not torch.equal(params["lm_head.weight"], model.lm_head.weight.detach())  # it trained
