#!/usr/bin/env bash
# The hspmd story on the built-in emulated CPU clusters (cpu-hetero4-sleep; cpu-hetero4 for the formats and
# the checkpoint's continuation). Each capability adds its act.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${DEMO_OUT:-demo-out}
mkdir -p "$OUT"

act() { printf '\n\033[1m== %s ==\033[0m\n' "$*"; }

act "1. The formats: a hand-written heterogeneous plan for llama-tiny on cpu-hetero4"
hspmd validate configs/plans/cpu-hetero4-tiny.yaml
hspmd show configs/plans/cpu-hetero4-tiny.yaml

act "   ... and a broken plan is refused with one line per problem (exit 2)"
cat > "$OUT/broken-plan.yaml" <<'YAML'
version: 1
model: llama-tiny
cluster: cpu-hetero4
training: {global_batch: 8, micro_batch: 1, seq_len: 64}
strategies:
- name: broken
  pipelines:
  - micro_batches: 8
    stages:
    - {devices: [0, 2], layers: [0, 4]}
    - {devices: [7], layers: [3, 6]}
YAML
if hspmd validate "$OUT/broken-plan.yaml"; then echo "expected a failure" >&2; exit 1; fi

act "2. The demo cluster: cpu-hetero4-sleep, 4 CPU processes emulating 2 A800 + 2 H20 (llama-32b's layer shapes)"
echo "each forward / backward block runs the real llama-tiny, then sleeps until it has lasted what its target"
echo "device's profile prices that block at (x time_scale): the devices mostly sleep, so they do not fight over"
echo "this host's cores, and a step's time is what the plan, the schedule and the communication make it"
echo "profile: time every Llama component on this CPU, measure the links (what the runtime does for real)"
hspmd profile --cluster cpu-hetero4-sleep --out "$OUT/profiles"

act "3. Plan: search TP groups, pipelines, layer splits, micro-batches (ILP) and each pipeline's schedule for the fastest plan that fits"
hspmd plan --model llama-tiny --cluster cpu-hetero4-sleep --profile "$OUT/profiles" --global-batch 16 \
  --seq-len 256 -o "$OUT/plan.yaml" --symmetric-out "$OUT/symmetric.yaml"
echo "(the H20s price a block ~1.8x an A800: the planner gives them a smaller share of the batch, where the"
echo " symmetric plan makes the A800s wait for them; the table says which schedule each pipeline runs and why)"
hspmd simulate --plan "$OUT/plan.yaml" --profile "$OUT/profiles" --trace "$OUT/simulated-trace.json"
hspmd simulate --plan "$OUT/symmetric.yaml" --profile "$OUT/profiles"

act "4. Train the planned plan, then the best symmetric (Megatron-style) plan, and compare measured step times"
echo "(the simulator's step times just above are what to compare them with)"
rm -rf "$OUT/checkpoint"
hspmd train --plan "$OUT/plan.yaml" --steps 15 --metrics "$OUT/planned-metrics.jsonl" --trace "$OUT/trace" \
  --save "$OUT/checkpoint" --save-every 5
hspmd train --plan "$OUT/symmetric.yaml" --steps 15 --metrics "$OUT/symmetric-metrics.jsonl"
python scripts/compare_runs.py planned="$OUT/planned-metrics.jsonl" symmetric="$OUT/symmetric-metrics.jsonl"
echo "per-step metrics: $OUT/planned-metrics.jsonl; Perfetto traces (open at ui.perfetto.dev): $OUT/trace/"
echo "checkpoints every 5 steps ($OUT/checkpoint/step-<N>/, 'latest' names the newest); the run resumed to step 20:"
hspmd train --plan "$OUT/plan.yaml" --steps 20 --save "$OUT/checkpoint" --save-every 5 --resume

act "5. The checkpoint (full tensors by name) continues under a different plan: a TP-2 pipeline + a 2-stage pipeline"
echo "(on cpu-hetero4, the other emulation mode: devices 2-3 sleep 2x each block's measured compute time)"
hspmd show configs/plans/cpu-hetero4-tiny.yaml --device 3
hspmd train --plan configs/plans/cpu-hetero4-tiny.yaml --load "$OUT/checkpoint" --steps 5 \
  --metrics "$OUT/continued-metrics.jsonl"

act "6. A device fails mid-run: replan on the survivors and switch in memory (no checkpoint, no restart)"
echo "what \`hspmd replan\` proposes if device 1 of the dp-pp plan fails, and what the switch costs against a restart:"
hspmd replan --plan configs/plans/cpu-hetero4-sleep-dp-pp.yaml --strategy dp-pp --failed 1 --profile "$OUT/profiles"
echo "now for real: device 1's worker is SIGKILLed at the start of step 6; the survivors abandon the step, the"
echo "launcher replans, the survivors form a new process group, move the state by fused BSR and redo step 6;"
echo "device 1 returns for step 12: it joins if the planner predicts the gain beats the switch, and gets its state"
echo "from the holders by fused BSR (no restart)"
hspmd train --plan configs/plans/cpu-hetero4-sleep-dp-pp.yaml --strategy dp-pp --elastic --profile "$OUT/profiles" \
  --kill-device 1 --at-step 6 --rejoin-device 1 --rejoin-at-step 12 --steps 24 --metrics "$OUT/elastic-metrics.jsonl"
echo "the failure and the return as logged in $OUT/elastic-metrics.jsonl:"
grep '"event"' "$OUT/elastic-metrics.jsonl"
printf 'steps: 24\nevents:\n  - {step: 6, action: kill, devices: [1]}\n  - {step: 12, action: rejoin, devices: [1]}\n' \
  > "$OUT/trace.yaml"
echo "the same trace modelled: goodput against checkpoint-restart and an Oobleck-like baseline"
hspmd simulate --plan configs/plans/cpu-hetero4-sleep-dp-pp.yaml --strategy dp-pp --profile "$OUT/profiles" \
  --events "$OUT/trace.yaml"

act "7. Mixed sequence lengths: long-tailed documents, two strategies by length range, a strategy chosen per step"
echo "cpu-hetero4-long64k: this host in sleep mode at paper-scale lengths and memory: each real token stands for"
echo "256 of llama-70b's layer shapes and the devices' memory is the A800's and H20's for those shapes, so"
echo "llama-tiny's 256-token maximum weighs as 64K tokens there (attention grows as s^2; one replica's state"
echo "needs two devices; a 64K document needs all four in one pipeline, or recompute). Plan documents of"
echo "longtail lengths (most short, a few long), 512 tokens a step: each strategy serves a length range. A run"
echo "holds only the running strategy's state and switches in stages, so the strategies need not fit side by side"
hspmd plan --model llama-tiny --cluster cpu-hetero4-long64k --lengths longtail --tokens-per-step 512 \
  -o "$OUT/lengths-plan.yaml" --fixed-out "$OUT/lengths-fixed.yaml"
echo "(at 32K, cpu-hetero4-long, one strategy is the plan: an H20 pair holds the longest document without"
echo " recompute, so a composite of a long-document and a short-document pipeline serves every step)"
hspmd simulate --plan "$OUT/lengths-plan.yaml" --lengths longtail --steps 8
echo "train it: every rank draws the same documents, picks the same strategy and deals the documents to"
echo "pipelines by predicted cost (--dispatch-costs profiles: the planner's, as simulated); documents are packed"
echo "into micro-batches (attention stays inside each document), and a strategy change moves the state in"
echo "memory by fused BSR, a few layers at a time, freeing the old strategy's tensors as it goes"
hspmd train --plan "$OUT/lengths-plan.yaml" --lengths longtail --steps 8 --dispatch-costs profiles \
  --metrics "$OUT/lengths-metrics.jsonl"
echo "the per-step choices (strategy of each step, switches):"
python - "$OUT/lengths-metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
for r in rows:
    if "event" in r:
        print(f"  switch before step {r['step']}: {r['from']} -> {r['to']}, {r['switch_bytes'] / 1e6:.2f} MB "
              f"in {r['transfer_s'] * 1e3:.0f} ms (modelled gain {r['modelled_gain_s']:.2f} s)")
    else:
        print(f"  step {r['step']}: {r['strategy']}, {r['documents']} documents, {r['step_time_s']:.2f} s "
              f"(predicted {r['predicted_s']:.2f} s)")
PY
echo "the same documents on the best single plan for the longest document (what planning for 64K alone gives),"
echo "with the same dispatch:"
hspmd train --plan "$OUT/lengths-fixed.yaml" --lengths longtail --steps 8 --dispatch-costs profiles \
  --metrics "$OUT/lengths-fixed-metrics.jsonl"
python scripts/compare_runs.py hspmd="$OUT/lengths-metrics.jsonl" fixed="$OUT/lengths-fixed-metrics.jsonl"
echo "(expect hspmd ahead by about the plan's predicted speedup above: scripts/bench_lengths.py --part measured,"
echo " docs/benchmarks.md, bench_lengths)"

act "8. Mixture of experts: a Mixtral / Qwen-MoE-style model with its experts placed unevenly (expert parallelism)"
echo "moe-tiny on cpu-hetero4: each pipeline is a fast and a slow device; attention is TP-2 over the pair, and of the"
echo "4 routed experts the fast device holds 3, the slow one 1; tokens reach their experts by all_to_all_single"
hspmd show configs/plans/cpu-hetero4-moe-ep.yaml --device 2
hspmd train --plan configs/plans/cpu-hetero4-moe-ep.yaml --steps 4 --metrics "$OUT/moe-metrics.jsonl"
echo "(every placement trains the same numbers: tests/integration/test_expert_parallel.py checks each against the"
echo " single-device model; the planner places experts by speed, memory and load: docs/moe.md)"
