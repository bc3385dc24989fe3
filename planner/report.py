"""What ``hspmd plan`` shows: the plan, its predicted step time against the baselines and the lower bound,
memory headroom per device, idle devices and why; as rich tables or as one JSON object."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from planner.api import PlanResult, schedule_reason
from planner.baselines import Baseline
from planner.cost import has_tp_stage
from planner.margin import MemoryMargin, headroom_rows
from planner.search import schedule_label
from runtime.torchfree.annotations.states import span
from runtime.torchfree.spec.plan import Plan
from runtime.torchfree.spec.schema import to_data

NO_MARGIN = MemoryMargin()


def _baseline_json(result: PlanResult, b: Baseline) -> dict[str, Any]:
    return {"step_time_s": b.step_time_s, "speedup": result.speedup(b), "micro_batch": b.micro_batch,
            "description": b.description,
            "mfu": None if b.estimate is None else b.estimate.mfu}


def memory_rows(result: PlanResult, index: int = 0, margin: MemoryMargin = NO_MARGIN) -> list[dict[str, Any]]:
    """Per stage of the chosen strategy: devices, peak memory, capacity, the margin kept, headroom."""
    cand = result.candidates[index]
    return headroom_rows(cand.strategy, {d: m.total for d, m in cand.estimate.memory.items()}, result.cluster,
                         margin)


def schedule_rows(result: PlanResult) -> list[dict[str, Any]]:
    """Per pipeline of the chosen plan: its schedule, chunks, and every schedule's time and memory on its
    stages (``api.schedule_options``), with the reason in one sentence."""
    rows = []
    default = result.settings.default_schedule
    for pi, (pipe, options) in enumerate(zip(result.best.strategy.pipelines, result.schedule_options)):
        rows.append({"pipeline": pi, "schedule": pipe.schedule if pipe.schedule is not None else default,
                     "chunks": pipe.stages[0].chunks, "label": schedule_label(pipe, default),
                     "searched": result.settings.schedule, "reason": schedule_reason(list(options)),
                     "options": [{"schedule": o.label, "pipeline_s": o.pipeline_s, "oom_devices": list(o.oom_devices),
                                  "chosen": o.chosen, "note": o.note} for o in options]})
    return rows


def result_json(result: PlanResult, plan: Plan, out_path: str | None, margin: MemoryMargin = NO_MARGIN
                ) -> dict[str, Any]:
    best = result.best
    est = best.estimate
    lb = result.lower_bound
    return {
        "plan": to_data(plan),
        "output": out_path,
        "step_time_s": est.step_time_s,
        "simulated_step_time_s": best.simulated_s,
        "tokens_per_s": est.tokens_per_s,
        "mfu": est.mfu,
        "micro_batch": best.micro_batch,
        "summary": best.summary,
        "zero_choice": result.zero_choice or None,
        "sequence_parallel": plan.training.sequence_parallel,
        "baselines": {
            "symmetric": _baseline_json(result, result.symmetric),
            "symmetric_subset": _baseline_json(result, result.symmetric_subset),
            "lower_bound": {"step_time_s": lb.step_time_s, "micro_batch": lb.micro_batch,
                            "efficiency": result.efficiency, "best_tp": dict(lb.best_tp)},
        },
        "solver_time_s": result.solver_time_s,
        "search": {"truncated": result.stats.truncated, "cut_short": list(result.stats.cut_short),
                   "proxy_estimate": best.proxy,
                   "block_evaluations": result.stats.block_evaluations,
                   "combinations": result.stats.combinations, "finalists": result.stats.finalists,
                   "ilps": result.stats.ilps},
        "memory_margin": {**margin.to_json(), "text": margin.text},
        "memory": memory_rows(result, 0, margin),
        "schedules": schedule_rows(result),
        **({"experts": [c.to_json() for c in result.moe_stages]} if result.model.moe is not None else {}),
        "idle_devices": [{"device_type": g.device_type, "devices": list(g.devices), "reason": g.reason}
                         for g in result.idle],
        "candidates": [{"rank": i + 1, "step_time_s": c.step_time_s, "simulated_step_time_s": c.simulated_s,
                        "micro_batch": c.micro_batch, "summary": c.summary, "idle_devices": list(c.idle_devices)}
                       for i, c in enumerate(result.candidates)],
    }


def tp_text(tp: int, sequence_parallel: bool) -> str:
    """A stage's TP degree for tables: '2 sp' where it runs sequence parallel."""
    return f"{tp} sp" if sequence_parallel and tp > 1 else str(tp)


def zero_text(copies: int) -> str:
    return "off" if not copies else "on" if copies == 1 else f"on, {copies} copies of each moment chunk"


def print_report(con: Console, result: PlanResult, out_path: str | None, margin: MemoryMargin = NO_MARGIN) -> None:
    best = result.best
    est = best.estimate
    s = result.settings
    con.print(f"[bold]{escape(result.model.name)}[/bold] on [bold]{escape(result.cluster.name)}[/bold] "
              f"({len(result.devices)} devices), global batch {s.global_batch} x {s.seq_len} tokens, "
              f"micro-batch {best.micro_batch}, ZeRO-1 {zero_text(s.zero)}{' (elastic)' if s.elastic else ''}")
    sp = s.sequence_parallel and has_tp_stage(best.strategy)
    if sp:
        con.print("sequence parallelism on every TP stage (TP column: sp): norms and saved residuals sharded "
                  "along the sequence")
    if result.zero_choice:
        con.print(escape(result.zero_choice))
    con.print(f"plan: {escape(best.summary)}")
    table = Table(title="pipelines x stages (one micro-batch per stage)", title_justify="left")
    for col in ("pipe", "mb", "schedule", "stage", "type", "TP", "devices", "layers", "recompute", "stage s",
                "peak GiB", "cap GiB", "margin GiB", "headroom"):
        table.add_column(col, justify="left" if col in ("type", "devices", "layers") else "right")
    rows = memory_rows(result, 0, margin)
    mem = {(r["pipeline"], r["stage"]): r for r in rows}
    for pi, (pipe, pe) in enumerate(zip(best.strategy.pipelines, est.pipelines)):
        for si, (st, sc) in enumerate(zip(pipe.stages, pe.stages)):
            r = mem[pi, si]
            table.add_row(str(pi) if si == 0 else "", str(pipe.micro_batches) if si == 0 else "",
                          schedule_label(pipe, s.default_schedule) if si == 0 else "", str(si),
                          r["device_type"], tp_text(st.tp, sp), span(st.devices), st.layers_text(),
                          st.recompute_text(), f"{sc.time_s:.4f}", f"{r['peak_gib']:.1f}",
                          f"{r['capacity_gib']:g}", f"{r['margin_gib']:g}", f"{r['headroom_frac']:.0%}")
    con.print(table)
    searched = "searched per pipeline" if s.schedule == "auto" else f"fixed by --schedule {s.schedule}"
    seen = set()
    for row in schedule_rows(result):
        if (row["label"], row["reason"]) in seen:
            continue   # alike pipelines: said once
        seen.add((row["label"], row["reason"]))
        con.print(f"schedule ({searched}) of pipeline {row['pipeline']}: [bold]{escape(row['label'])}[/bold] — "
                  f"{escape(row['reason'])}")
    con.print(f"predicted step time [bold]{est.step_time_s:.4f} s[/bold] ({est.tokens_per_s:,.0f} tokens/s, "
              f"MFU {est.mfu:.1%}); pipelines {max(p.time_s for p in est.pipelines):.4f} s, gradient sync "
              f"{est.grad_sync_s:.4f} s, optimizer + clip {est.optimizer_s:.4f} s")
    if best.simulated_s is not None:
        con.print(f"simulated step time {best.simulated_s:.4f} s (the schedule and the gradient-sync order played "
                  f"out; candidates checked so are ranked by the worse of the two)")
    base = Table(title="against the baselines (same cost model)", title_justify="left")
    for col in ("baseline", "configuration", "step s", "planned speedup"):
        base.add_column(col, justify="left" if col in ("baseline", "configuration") else "right")
    for b in (result.symmetric, result.symmetric_subset):
        base.add_row(b.name, escape(b.description), "-" if b.step_time_s is None else f"{b.step_time_s:.4f}",
                     "-" if (speedup := result.speedup(b)) is None else f"{speedup:.2f}x")
    lb = result.lower_bound
    base.add_row("lower bound", "all devices at their best compute rate, no comm / bubbles / optimizer",
                 f"{lb.step_time_s:.4f}", f"efficiency {result.efficiency:.1%}")
    con.print(base)
    low = min(rows, key=lambda r: r["headroom_frac"])
    con.print(f"memory: tightest stage is pipeline {low['pipeline']} stage {low['stage']} ({low['device_type']}): "
              f"{low['peak_gib']:.1f} of {low['capacity_gib']:g} GiB, {low['headroom_frac']:.0%} free; margin "
              f"{margin.text} (--memory-margin): " + ("every stage keeps it" if all(r["within_margin"] for r in rows)
                                                      else "[red]not kept by every stage[/red]"))
    if result.idle:
        for g in result.idle:
            con.print(f"[yellow]idle[/yellow] {len(g.devices)} x {escape(g.device_type)} "
                      f"(devices {','.join(map(str, g.devices))}): {escape(g.reason)}")
    else:
        con.print("idle devices: none")
    print_experts(con, result)
    if len(result.candidates) > 1:
        alt = Table(title="near-best candidates", title_justify="left")
        for col in ("rank", "step s", "simulated s", "mb", "plan"):
            alt.add_column(col, justify="left" if col == "plan" else "right")
        for i, c in enumerate(result.candidates):
            sim = "-" if c.simulated_s is None else f"{c.simulated_s:.4f}"
            alt.add_row(str(i + 1), f"{c.step_time_s:.4f}", sim, str(c.micro_batch), escape(c.summary))
        con.print(alt)
    st = result.stats
    trunc = ""
    if st.truncated:
        where = f": {', '.join(st.cut_short)}" if st.cut_short else ""
        trunc = f" [yellow](time limit reached: search cut short{escape(where)}; the best plan found so far"
        if result.best.proxy:
            trunc += ", its step time by the search's closed-form proxy, not priced exactly"
        trunc += ")[/yellow]"
    con.print(f"searched {st.block_evaluations} pipeline groupings, {st.combinations} combinations, "
              f"{st.ilps} ILPs in {result.solver_time_s:.2f} s{trunc}")
    if out_path is not None:
        con.print(f"plan written to [bold]{escape(out_path)}[/bold]")
    else:
        con.print("plan not saved (use -o plan.yaml)")


def print_experts(con: Console, result: PlanResult) -> None:
    """A MoE model: per multi-device stage, how its experts are placed and why; per device its experts,
    expected rows per micro-batch and MoE layer, their share and its expert time."""
    for c in result.moe_stages:
        con.print(f"experts of pipeline {c.pipeline} stage {c.stage} (devices {','.join(map(str, c.devices))}): "
                  f"{escape(c.why)}")
        if not c.expert_parallel or not all("rows" in v for v in c.devices_detail.values()):
            continue
        t = Table(title_justify="left")
        for col in ("device", "type", "experts", "rows", "load", "expert ms"):
            t.add_column(col, justify="left" if col in ("type", "experts") else "right")
        for d, v in c.devices_detail.items():
            t.add_row(str(d), escape(v["type"]), ",".join(map(str, v["experts"])), f"{v['rows']:.0f}",
                      f"{v['load']:.1%}", f"{v['expert_ms']:.3f}")
        con.print(t)
