"""How well the profiler's TP figures price a whole TP stage: the profile's block decomposition next to that
stage timed whole, as the engine runs it, in one run (ratios within one run: the host's load moves both).

    python scripts/bench_tp_profile.py [--model llama-tiny] [--seq-len 256] [--layers 6] [--repeats 2] [--json]

Two gloo processes pinned as the launcher pins devices 0 and 1 of cpu-hetero4 (one core each on this host)
run, ``--repeats`` times in turn:

* ``in_turns`` (the alternative the profiler does not use): the ``STAGE_VARIANTS`` TP stage modules and
  their local shards taking turns, one forward and one backward each, a barrier per repeat, trimmed mean of 9;
* ``back_to_back`` (what ``compute.measure_tp_overhead`` does): the same stages, each run as the engine runs a
  stage's micro-batches (8 x (forward, backward) back to back, 3 rounds), also with sequence parallelism;
* ``whole``: the TP stage of the TP plans of scripts/bench_simulator.py (``--layers`` layers, embedding and
  head: tp2-fast's only stage, hetero-tp2-pp2's TP pipeline), with and without sequence parallelism, and its
  local shards, timed back to back the same way (the reference).

Each method's TP overhead blocks price the whole stage as the cost model does (``layers`` x layer + stage +
embedding + head), on top of the local stage blocks as the profiler measures them (``time_in_turns``,
medians); rank 0 prints, per repeat and clock (wall, process CPU) and phase (F, B), the predicted and the
whole-stage times and their ratio, plus the TP overhead alone (prediction vs whole TP - whole local).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hetu_cli.emulation import cpu_shares  # noqa: E402
from runtime.engine.tensor_parallel import apply_tensor_parallel  # noqa: E402
from runtime.models.llama import LlamaForCausalLM  # noqa: E402
from runtime.profiling import compute, host  # noqa: E402
from runtime.torchfree.models.params import llama_parameters  # noqa: E402
from runtime.torchfree.spec import load_model  # noqa: E402

TP = 2
CLOCKS = ("wall", "cpu")
METHODS = ("in_turns", "back_to_back", "back_to_back_sp")


def price(blocks: dict[str, tuple[float, float]], layers: int) -> tuple[float, float]:
    """A first-and-last stage of ``layers`` layers from its blocks, as planner/cost.py ``stage`` adds them."""
    return tuple(layers * blocks["layer"][j] + blocks["stage"][j] + blocks["embedding"][j] + blocks["head"][j]
                 for j in (0, 1))  # type: ignore[return-value]


def worker(rank: int, init: str, args: argparse.Namespace, queue) -> None:
    share = cpu_shares(range(4), 4, host.host_cpus())
    host.pin_process(share.cpus[rank])
    torch.set_num_threads(share.threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=TP, timeout=timedelta(seconds=600))
    model = load_model(args.model)
    dev = torch.device("cpu")
    s, n = args.seq_len, args.layers
    group = dist.new_group([0, 1])
    mesh = DeviceMesh.from_group(group, "cpu")

    def tp_stage(layers: int, embed: bool, head: bool, sp: bool) -> torch.nn.Module:
        stage = LlamaForCausalLM(model, range(layers), embed=embed, head=head)
        infos = [i for i in llama_parameters(model) if (i.owner == "embedding" and embed) or
                 (i.owner == "head" and head) or (i.owner == "layer" and i.layer is not None and i.layer < layers)]
        apply_tensor_parallel(stage, infos, mesh, sequence_parallel=sp)
        return stage

    def run(layers: int, embed: bool, head: bool, module=None) -> compute.StageRun:
        return compute.StageRun(model, TP, layers, embed, head, 1, s, dev, module=module)

    variants = compute.STAGE_VARIANTS
    old_runs = {}
    for name, (e, h, k) in variants.items():
        old_runs["tp", name] = run(k, e, h, tp_stage(k, e, h, False))
        old_runs["local", name] = run(k, e, h)
    whole = {"tp": run(n, True, True, tp_stage(n, True, True, False)),
             "sp": run(n, True, True, tp_stage(n, True, True, True)), "local": run(n, True, True)}
    local_runs = {name: run(k, e, h) for name, (e, h, k) in variants.items()}
    out = []
    for rep in range(args.repeats):
        t0, c0, load0 = time.perf_counter(), time.process_time(), os.getloadavg()[0]
        dist.barrier()
        # the local stage blocks, as the profiler's measure_stage_blocks times them (medians of turns)
        loc = compute.time_in_turns(local_runs, dev, min_reps=7, max_reps=40, budget_s=0.1, warmup=2)
        local_blocks = {c: compute.stage_blocks({k: loc[k][i] for k in variants}) for i, c in enumerate(CLOCKS)}
        dist.barrier()
        old = compute.time_in_turns(old_runs, dev, min_reps=9, max_reps=9, budget_s=0.0, warmup=2,
                                    barrier=lambda: dist.barrier(group=group), mean=True)
        old_blocks = {c: compute.tp_overhead_blocks({k: old["tp", k][i] for k in variants},
                                                    {k: old["local", k][i] for k in variants})
                      for i, c in enumerate(CLOCKS)}
        new = compute.measure_tp_overhead(model, TP, group, [s], device=dev)
        times = compute.time_back_to_back(whole, dev, micro_batches=compute.TP_MICRO_BATCHES,
                                          rounds=compute.TP_ROUNDS, barrier=lambda: dist.barrier(group=group))
        rec = {"repeat": rep, "load_start": load0, "load_end": os.getloadavg()[0],
               "wall_s": time.perf_counter() - t0, "process_cpu_s": time.process_time() - c0}
        if new is not None:
            methods = {"in_turns": {c: old_blocks[c] for c in CLOCKS},
                       "back_to_back": {c: {k: (v[0].forward_s, v[0].backward_s) for k, v in new[c].items()}
                                        for c in CLOCKS},
                       "back_to_back_sp": {c: {k: (v[0].forward_s, v[0].backward_s) for k, v in new[f"sp_{c}"].items()}
                                           for c in CLOCKS}}
            for i, c in enumerate(CLOCKS):
                tp_whole, sp_whole, lw = (times[k][i] for k in ("tp", "sp", "local"))
                base = price(local_blocks[c], n)
                rec[c] = {"whole_tp": tp_whole, "whole_sp": sp_whole, "whole_local": lw, "local_blocks_priced": base}
                for name, blocks in methods.items():
                    over = price(blocks[c], n)
                    ref = sp_whole if name.endswith("_sp") else tp_whole
                    ref_over = tuple(ref[j] - lw[j] for j in (0, 1))
                    pred = tuple(base[j] + over[j] for j in (0, 1))
                    rec[c][name] = {"overhead_priced": over, "overhead_whole": ref_over,
                                    "overhead_ratio": tuple(over[j] / ref_over[j] if ref_over[j] > 0 else None
                                                            for j in (0, 1)),
                                    "stage_priced": pred, "stage_ratio": tuple(pred[j] / ref[j] for j in (0, 1))}
            out.append(rec)
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hspmd-tpbench-") as tmp:
        init = f"file://{Path(tmp) / 'store'}"
        procs = [ctx.Process(target=worker, args=(r, init, args, queue)) for r in range(TP)]
        for p in procs:
            p.start()
        result = queue.get(timeout=1800)
        for p in procs:
            p.join(timeout=60)
    def median(xs: list) -> float:
        kept = [x for x in xs if x is not None]   # an overhead timed whole at <= 0 has no ratio
        return statistics.median(kept) if kept else float("nan")

    summary = {name: {c: {key: [median([rec[c][name][key][j] for rec in result]) for j in (0, 1)]
                          for key in ("stage_ratio", "overhead_ratio")} for c in CLOCKS}
               for name in METHODS}
    if args.json:
        print(json.dumps({"repeats": result, "median_over_repeats": summary}, indent=1))
        return
    for rec in result:
        print(f"repeat {rec['repeat']}: load {rec['load_start']:.2f} -> {rec['load_end']:.2f}, "
              f"{rec['wall_s']:.1f} s wall, rank 0 process CPU {rec['process_cpu_s']:.1f} s")
        for c in CLOCKS:
            r = rec[c]
            print(f"  {c}: whole TP stage F/B {r['whole_tp'][0] * 1e3:.1f}/{r['whole_tp'][1] * 1e3:.1f} ms, "
                  f"SP {r['whole_sp'][0] * 1e3:.1f}/{r['whole_sp'][1] * 1e3:.1f}, local "
                  f"{r['whole_local'][0] * 1e3:.1f}/{r['whole_local'][1] * 1e3:.1f}")
            for name in METHODS:
                m = r[name]
                print(f"    {name:16s} stage priced {m['stage_priced'][0] * 1e3:.1f}/{m['stage_priced'][1] * 1e3:.1f} "
                      f"ms (x{m['stage_ratio'][0]:.3f}/x{m['stage_ratio'][1]:.3f}); overhead priced "
                      f"{m['overhead_priced'][0] * 1e3:.1f}/{m['overhead_priced'][1] * 1e3:.1f} vs whole "
                      f"{m['overhead_whole'][0] * 1e3:.1f}/{m['overhead_whole'][1] * 1e3:.1f}")
    print("median over the repeats, priced / timed whole (F/B):")
    for name, by_clock in summary.items():
        print(f"  {name:16s} " + "; ".join(f"{c}: stage x{v['stage_ratio'][0]:.3f}/x{v['stage_ratio'][1]:.3f}, "
                                          f"overhead x{v['overhead_ratio'][0]:.3f}/x{v['overhead_ratio'][1]:.3f}"
                                          for c, v in by_clock.items()))


if __name__ == "__main__":
    main()
