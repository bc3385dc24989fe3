"""Cross-checks of a plan against its model and cluster: every problem, with its field path."""

from __future__ import annotations

from runtime.torchfree.errors import Problem, listed
from runtime.torchfree.schedule_policies import (
    SCHEDULE_NAMES,
    chunk_problems,
    limit_problems,
    schedule_layout,
    schedule_problems,
)
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import Plan, Stage, Strategy


def validate_plan(plan: Plan, model: ModelSpec, cluster: Cluster, file: str = "") -> list[Problem]:
    problems: list[Problem] = []
    t = plan.training
    if t.seq_len > model.max_seq_len:
        problems.append(Problem(file, "training.seq_len",
                                f"{t.seq_len} exceeds {model.name}'s max_seq_len {model.max_seq_len}"))
    for si, strategy in enumerate(plan.strategies):
        # Every slice has a replica in each pipeline (so r <= pipelines always fits), and a slice split at
        # the finest TP degree no more: the pipelines are what bounds the copies of a moment chunk.
        if t.zero and t.zero_redundancy > len(strategy.pipelines):
            problems.append(Problem(file, "training.zero_redundancy",
                                    f"{t.zero_redundancy} copies of each ZeRO-1 moment chunk need as many data-"
                                    f"parallel replicas; strategy {strategy.name!r} has {len(strategy.pipelines)} "
                                    "pipeline(s)"))
        problems.extend(validate_strategy(strategy, plan, model, cluster, file, f"strategies[{si}]"))
    problems.extend(validate_length_ranges(plan, file))
    return problems


def validate_length_ranges(plan: Plan, file: str = "") -> list[Problem]:
    """Strategies tagged with ``max_seq_len`` split the lengths 1..training.seq_len into consecutive ranges
    (previous max, max], in plan order: each must end above the previous one (no empty range), none past
    training.seq_len (the run's longest document), and the last must reach it (no length left uncovered).
    Plans without any tag keep their strategies as alternatives (``--strategy``) and are not checked."""
    if all(s.max_seq_len is None for s in plan.strategies):
        return []
    problems: list[Problem] = []
    t = plan.training
    prev = 0
    for si, s in enumerate(plan.strategies):
        top = s.max_len_of(t)
        where = f"strategies[{si}].max_seq_len"
        if top > t.seq_len:
            problems.append(Problem(file, where, f"{top} exceeds training.seq_len {t.seq_len}, the longest document "
                                                 "of the run"))
        elif top <= prev:
            problems.append(Problem(file, where, f"{top} does not exceed the previous strategy's {prev}: length "
                                                 "ranges ascend in plan order"))
        prev = max(prev, top)
    if prev < t.seq_len and not problems:
        last = len(plan.strategies) - 1
        problems.append(Problem(file, f"strategies[{last}].max_seq_len",
                                f"the strategies serve documents up to {prev} tokens, leaving ({prev}, {t.seq_len}] "
                                f"(up to training.seq_len) uncovered"))
    return problems


def validate_strategy(strategy: Strategy, plan: Plan, model: ModelSpec, cluster: Cluster,
                      file: str, path: str) -> list[Problem]:
    problems: list[Problem] = []

    def bad(field: str, message: str) -> None:
        problems.append(Problem(file, f"{path}.{field}", message))

    t = plan.training
    n_dev = cluster.num_devices
    owner: dict[int, str] = {}
    for pi, pipe in enumerate(strategy.pipelines):
        pp = f"pipelines[{pi}]"
        # Layers: the virtual stages, in the schedule's placement order, tile [0, num_layers).
        name = strategy.schedule_of(pi, t)
        chunks = {stage.chunks for stage in pipe.stages}
        sched = schedule_problems(name, len(pipe.stages), pipe.micro_batches,
                                  chunks.pop() if len(chunks) == 1 else None)
        for line in sched:
            field, message = line.split(": ", 1)
            if field == "schedule":
                where = f"{path}.{pp}.schedule" if pipe.schedule is not None else "training.schedule"
                problems.append(Problem(file, where, message))
            elif field == "chunks":
                bad(f"{pp}.stages", f"{message} (the layer ranges each stage lists, under {name})")
            else:
                bad(f"{pp}.{field}", message)
        uniform = len({stage.chunks for stage in pipe.stages}) == 1
        lines = [] if sched or not uniform or pipe.activation_limits is None else limit_problems(
            name, len(pipe.stages), pipe.micro_batches, pipe.stages[0].chunks, pipe.activation_limits)
        placement = schedule_layout(name, 1).placement if name in SCHEDULE_NAMES else "loop"
        wrong_count = any(line.startswith("chunks: ") for line in sched)  # then no placement to check against
        ranges = [s.layers for s in pipe.stages]
        for line in lines + ([] if wrong_count else chunk_problems(ranges, model.num_layers, placement, model.name)):
            field, message = line.split(": ", 1)
            bad(f"{pp}.{field}", message)
        for k, stage in enumerate(pipe.stages):
            sp = f"{pp}.stages[{k}]"
            # Devices.
            types = set()
            nodes = set()
            for di, d in enumerate(stage.devices):
                if not 0 <= d < n_dev:
                    bad(f"{sp}.devices[{di}]", f"unknown device id {d} (cluster {cluster.name!r} has "
                                               f"devices 0-{n_dev - 1})")
                    continue
                if d in owner:
                    bad(f"{sp}.devices[{di}]", f"device {d} is also used by {owner[d]}")
                else:
                    owner[d] = f"{path}.{sp}"
                dev = cluster.device(d)
                types.add(dev.type)
                nodes.add(dev.node)
            if len(types) > 1 and not stage.expert_parallel:
                bad(f"{sp}.devices", f"mixes device types {sorted(types)}: a TP group must be one type (a stage "
                                     "with experts may mix them)")
            if len(nodes) > 1 and not stage.expert_parallel:
                bad(f"{sp}.devices", f"spans nodes {sorted(nodes)}: a TP group must be on one node (a stage with "
                                     "experts may span nodes)")
            why = model.tp_problem(stage.tp)
            if why is not None:
                bad(f"{sp}.devices", f"{why} of {model.name}")
            if stage.experts is not None:
                for field, message in expert_problems(stage, model):
                    bad(f"{sp}.{field}", message)
            if t.sequence_parallel and stage.tp > 1:
                # Every sequence splits in tp equal pieces (documents mode: rows of the strategy's longest).
                odd = [n for n in sorted({t.seq_len, strategy.max_len_of(t)}) if n % stage.tp]
                if odd:
                    bad(f"{sp}.devices", f"TP degree {stage.tp} does not divide sequence length {odd[0]} "
                                         "(training.sequence_parallel shards the sequence over the TP group)")
    if t.sequence_parallel and all(st.tp == 1 for p in strategy.pipelines for st in p.stages):
        problems.append(Problem(file, "training.sequence_parallel",
                                f"needs a TP stage (2 or more devices); strategy {strategy.name!r} has none"))
    total = sum(p.micro_batches for p in strategy.pipelines) * t.micro_batch
    if total != t.global_batch:
        counts = " + ".join(str(p.micro_batches) for p in strategy.pipelines)
        bad("pipelines", f"micro-batches ({counts}) x micro_batch {t.micro_batch} = {total} samples, "
                         f"but training.global_batch is {t.global_batch}")
    return problems


def expert_problems(stage: Stage, model: ModelSpec) -> list[tuple[str, str]]:
    """(field, message) for what is wrong with an expert-parallel stage's placement against the model."""
    moe = model.moe
    if moe is None:
        return [("experts", f"{model.name} has no mixture-of-experts layers to place")]
    if not any(moe.is_moe_layer(i) for i in stage.layer_ids):
        return [("experts", f"the stage holds no MoE layer of {model.name} (layers {stage.layers_text()})")]
    out = []
    n = moe.num_experts
    for d, held in stage.experts or ():
        unknown = [e for e in held if e >= n]
        if unknown:
            out.append((f"experts.{d}", f"expert(s) {listed(unknown)} do not exist: {model.name} has experts "
                                        f"0-{n - 1}"))
    held_somewhere = {e for _, held in stage.experts or () for e in held}
    unheld = [e for e in range(n) if e not in held_somewhere]
    if unheld:
        out.append(("experts", f"leaves expert(s) {listed(unheld)} unheld: every expert needs at least one device"))
    idle = [d for d in stage.devices if not stage.experts_of(d)]
    if idle:
        out.append(("experts", f"device(s) {listed(idle)} hold no expert: {n} experts cannot spread over {stage.tp} "
                               "devices without replicas (replicate hot experts, or place the experts on fewer "
                               "devices)"))
    return out
