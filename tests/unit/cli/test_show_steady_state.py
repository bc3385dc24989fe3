"""``hspmd show --device``: a schedule's steady state over many micro-batches is listed once with a count
(``steady_runs``); every run it folds really is one block of ops repeated on later micro-batches, the
lines it shows are the program's, ``--all-ops`` and ``--format json`` list every op."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from hetu_cli.commands.show import MIN_REPEATS, steady_runs
from hetu_cli.main import cli
from runtime.torchfree.engine.describe import OpLine, describe_program
from runtime.torchfree.pipeline_schedules import Compute, Message, PostRecv, PostSend, WaitRecv
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.handle import StrategyHandle

ENGINE_PLANS = Path(__file__).resolve().parents[2] / "integration" / "engine_plans"


def scaled(tmp_path: Path, name: str, factor: int) -> Path:
    """An engine test plan with ``factor`` times its micro-batches (and global batch)."""
    data = yaml.safe_load((ENGINE_PLANS / name).read_text())
    for ref in ("model", "cluster"):
        if data[ref].endswith(".yaml"):
            data[ref] = str(ENGINE_PLANS / data[ref])
    data["training"]["global_batch"] *= factor
    for s in data["strategies"]:
        for p in s["pipelines"]:
            p["micro_batches"] *= factor
    out = tmp_path / name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def micro_batch(line: OpLine) -> int | None:
    a = line.action
    if isinstance(a, Compute):
        return a.micro_batch
    if isinstance(a, (PostSend, PostRecv, WaitRecv)):
        return a.message.micro_batch
    return None


def assert_runs_sound(ops, runs) -> None:
    prev_end = 0
    for first, period, repeats, step in runs:
        assert first >= prev_end and repeats >= MIN_REPEATS and period >= 1 and step >= 1
        prev_end = first + period * repeats
        assert prev_end <= len(ops)
        for r in range(1, repeats):
            for x in range(period):
                a, b = ops[first + x], ops[first + r * period + x]
                assert (a.kind, a.detail, type(a.action)) == (b.kind, b.detail, type(b.action))
                assert micro_batch(b) == micro_batch(a) + r * step
                assert b.name == a.name.replace(f"mb{micro_batch(a)}", f"mb{micro_batch(b)}")


def test_steady_runs_of_real_programs_are_repetitions(tmp_path: Path) -> None:
    for name in ("interleaved-hetero4.yaml", "zb-v-hetero4.yaml", "zb-h1-hetero4.yaml", "two-pipelines.yaml"):
        ctx = load_plan_context(scaled(tmp_path, name, 16))
        for s in ctx.plan.strategies:
            for device in StrategyHandle(ctx, s).devices:
                ops = describe_program(StrategyHandle(ctx, s), device).ops
                runs = steady_runs(ops)
                assert_runs_sound(ops, runs)
                folded = sum(period * (repeats - 2) for _, period, repeats, _ in runs)
                assert folded > len(ops) // 2, (name, device)   # the steady state is most of a long step


def test_show_folds_the_steady_state_and_all_ops_lists_it(tmp_path: Path) -> None:
    plan = scaled(tmp_path, "zb-h1-hetero4.yaml", 16)
    ctx = load_plan_context(plan)
    ops = describe_program(StrategyHandle.of(ctx), 0).ops
    (first, period, repeats, step), *_ = steady_runs(ops)
    res = CliRunner().invoke(cli, ["show", "--device", "0", str(plan)])
    assert res.exit_code == 0, res.output
    assert f"... the {period} ops above x {repeats - 2}" in res.output
    last = first + (repeats - 1) * period
    shown = [ops[k].name for k in (*range(first, first + period), *range(last, last + period))]
    hidden = [ops[k].name for k in range(first + period, last) if ops[k].name not in shown]
    assert all(n in res.output for n in shown) and not any(f"│ {n} " in res.output for n in hidden)
    full = CliRunner().invoke(cli, ["show", "--device", "0", "--all-ops", str(plan)])
    assert full.exit_code == 0 and "ops above x" not in full.output
    assert all(o.name in full.output for o in ops)
    data = json.loads(CliRunner().invoke(cli, ["show", "--device", "0", "--format", "json", str(plan)]).output)
    assert [o["name"] for o in data["programs"][0]["ops"]] == [o.name for o in ops]


def line(kind: str, mb: int, stage: int) -> OpLine:
    if kind == "send":
        a = PostSend(Message("activation", mb, stage, stage + 1, 0, 1))
    else:
        a = Compute(kind, mb, stage, 0)  # type: ignore[arg-type]
    return OpLine("comm" if kind == "send" else "compute", f"{kind} mb{mb}", f"stage {stage}", a)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["F", "BW", "send"]), st.integers(0, 3), st.integers(0, 1)),
                max_size=12),
       st.lists(st.tuples(st.sampled_from(["F", "BW", "send"]), st.integers(0, 2), st.integers(0, 1)),
                min_size=1, max_size=6),
       st.integers(1, 12), st.integers(1, 3))
def test_steady_runs_on_any_sequence(prefix, block, repeats, step) -> None:
    """Whatever the lines, every run reported is a repetition; a block repeated often enough is folded."""
    ops = [line(k, mb, s) for k, mb, s in prefix]
    ops += [line(k, 10 + mb + r * step, s) for r in range(repeats) for k, mb, s in block]
    runs = steady_runs(ops)
    assert_runs_sound(ops, runs)
    if repeats >= MIN_REPEATS + 2:
        start = len(prefix)
        covered = [(f, f + p * r) for f, p, r, _ in runs]
        # the repeated part is folded from at most one block in, to at most one block before its end
        assert any(a <= start + len(block) and b >= start + (repeats - 1) * len(block) for a, b in covered)
