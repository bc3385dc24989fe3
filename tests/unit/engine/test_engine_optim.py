"""AdamW on shards equals AdamW on the whole tensor; clipping matches torch; state round-trips; the
reference trainer's gradient accumulation equals one whole-batch pass."""

from __future__ import annotations

import dataclasses

import torch

from runtime.engine.optim import LocalAdamW, build_adamw, clip_coefficient
from runtime.engine.reference import ReferenceTrainer
from runtime.torchfree.spec import OptimizerSettings, TrainingSettings, load_model

SETTINGS = OptimizerSettings(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=1.0)


def test_adamw_on_shards_is_the_slice_of_the_full_update() -> None:
    g = torch.Generator().manual_seed(0)
    full = torch.nn.Parameter(torch.randn(8, 6, generator=g))
    ref = build_adamw([full], SETTINGS)
    shards = [full.detach().clone()[:4], full.detach().clone()[4:]]
    opts = [LocalAdamW({"w": s}, SETTINGS) for s in shards]
    for _ in range(4):
        grad = torch.randn(8, 6, generator=g)
        full.grad = grad.clone()
        ref.step()
        for opt, part in zip(opts, grad.split(4)):
            opt.step({"w": part.clone()}, None)
    torch.testing.assert_close(torch.cat(shards), full.detach(), rtol=1e-6, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(torch.cat([o.state()[f"w.{key}"] for o in opts]), ref.state[full][key],
                                   rtol=1e-6, atol=1e-10)
    assert opts[0].step_count == 4


def test_clip_coefficient_matches_torch() -> None:
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 3
    grads = [p.grad.clone() for p in params]
    norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    coef = clip_coefficient(torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in grads])), 0.5)
    assert coef is not None
    for p, x in zip(params, grads):
        torch.testing.assert_close(x * coef, p.grad)
    assert clip_coefficient(norm, 0.0) is None
    assert float(clip_coefficient(torch.tensor(0.1), 1.0)) == 1.0


def test_state_round_trip_continues_identically() -> None:
    g = torch.Generator().manual_seed(2)
    a_w, b_w = torch.randn(6, generator=g), torch.zeros(6)
    a = LocalAdamW({"w": a_w}, SETTINGS)
    grads = [torch.randn(6, generator=g) for _ in range(4)]
    for x in grads[:2]:
        a.step({"w": x.clone()}, torch.tensor(0.5))
    b = LocalAdamW({"w": b_w}, SETTINGS)
    b.load_state({k: v.clone() for k, v in a.state().items()})
    assert b.step_count == 2 and torch.equal(b_w, a_w)
    for x in grads[2:]:
        a.step({"w": x.clone()}, None)
        b.step({"w": x.clone()}, None)
    assert torch.equal(a_w, b_w)


def test_reference_micro_batching_equals_whole_batch() -> None:
    model = dataclasses.replace(load_model("llama-tiny"), num_layers=2)
    training = TrainingSettings(global_batch=4, micro_batch=1, seq_len=12, seed=3,
                                optimizer=dataclasses.replace(SETTINGS, lr=1e-3, eps=1e-5))
    whole, chunked = ReferenceTrainer(model, training), ReferenceTrainer(model, training, micro_batch=1)
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        batch = torch.randint(0, model.vocab_size, (4, 13), generator=g)
        sa, sb = whole.train_step(batch), chunked.train_step(batch)
        assert abs(sa.loss - sb.loss) <= 1e-5 * sa.loss and abs(sa.grad_norm - sb.grad_norm) <= 1e-5 * sa.grad_norm
        assert sa.tokens == 48
    for name, p in whole.parameters().items():
        torch.testing.assert_close(chunked.parameters()[name], p, rtol=1e-5, atol=1e-6)
    assert 5.0 < sa.loss < 6.0  # about ln(256) for a fresh model on random bytes


def test_recompute_saves_only_layer_inputs_and_gives_the_same_gradients() -> None:
    from runtime.engine.program import checkpoint_layers
    from runtime.models.llama import LlamaForCausalLM, causal_lm_loss_sum

    model = load_model("llama-tiny")
    plain, recomputed = LlamaForCausalLM(model), LlamaForCausalLM(model)
    plain.init_weights(0)
    recomputed.init_weights(0)
    checkpoint_layers(recomputed)
    x = torch.randint(0, model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    saved = []
    for m in (plain, recomputed):
        count = [0]

        def pack(t: torch.Tensor, count: list[int] = count) -> torch.Tensor:
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = causal_lm_loss_sum(m(x[:, :-1]), x[:, 1:])
        loss.backward()
        saved.append(count[0])
    assert saved[1] * 3 < saved[0], f"recompute kept {saved[1]} tensors for backward, plain {saved[0]}"
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in recomputed.named_parameters()]
    for (n, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=n)


def test_released_state_holds_no_storage_and_received_state_trains_on_identically() -> None:
    """A documents run's idle strategy: ``release`` frees the shard's storage (its module alias too) and the
    moments; ``receive`` allocates them again for a switch to write into; training then continues exactly as
    an optimizer that was never released."""
    g = torch.Generator().manual_seed(1)
    module_w = torch.randn(6, 4, generator=g)   # stands for the module's parameter: the optimizer aliases it
    opt, ref = LocalAdamW({"w": module_w}, SETTINGS), LocalAdamW({"w": module_w.clone()}, SETTINGS)
    grads = [torch.randn(6, 4, generator=g) for _ in range(3)]
    for o in (opt, ref):
        o.step({"w": grads[0].clone()}, None)
    saved = {k: v.clone() for k, v in opt.state().items()}
    opt.release()
    assert module_w.untyped_storage().nbytes() == 0 and not opt.optimizer.state
    into = opt.receive(["w"], step=1)
    assert module_w.untyped_storage().nbytes() == 6 * 4 * 4
    for k, t in into.items():   # what a switch's BSR does: write every element in place
        t.copy_(saved[k])
    for gr in grads[1:]:
        for o in (opt, ref):
            o.step({"w": gr.clone()}, None)
    for k, v in ref.state().items():
        torch.testing.assert_close(opt.state()[k], v, rtol=0, atol=0)
    torch.testing.assert_close(module_w, ref.state()["w"], rtol=0, atol=0)
