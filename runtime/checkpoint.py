"""Plan-independent checkpoints in Hugging Face's layout, and the older single-file format.

``--save DIR`` writes a directory that ``transformers`` opens with ``from_pretrained``:

* ``config.json``: the model's (the source config.json's keys kept when the model came from one), with
  ``torch_dtype``;
* ``model.safetensors``: the parameters by their Hugging Face names (``model.layers.3.mlp.up_proj.weight``),
  or ``model-0000i-of-0000N.safetensors`` shards and ``model.safetensors.index.json`` above ``SHARD_BYTES``;
* ``optimizer.safetensors``: ``NAME.exp_avg``, ``NAME.exp_avg_sq``, under aux-loss-free balancing
  (``moe.bias_update_rate``) each router's bias ``model.layers.{i}.{block}.gate.expert_bias``, and, in its
  metadata, the steps done.

A save stages every file under a temporary name before it renames any into place (``AtomicFiles``), so a
save that fails part-way leaves the previous one whole. The files of one save carry the same save id in
their metadata: ``--load`` refuses a directory that a crash during the renames left holding files of two
saves (naming them) instead of mixing them. ``--load DIR`` also takes a plain Hugging Face checkpoint
(weights only: moments start at zero, step 0) and the older ``checkpoint.safetensors`` (parameters and
moments in one file). Nothing depends on the plan that wrote a checkpoint, so any plan of the same model
can load it.

Saving is collective: the full tensors are assembled on the strategy's first device with the comm
layer's fused BSR (destination layout "whole tensor on one device"), a bounded number of bytes per
round, and written by that device. Loading is local: each device reads, from the lazily opened files
(safetensors slicing), exactly the region of each tensor that its program holds.

Under ZeRO-1 (``training.zero``, runtime/torchfree/engine/zero.py) a sharded parameter's moments are kept as
pieces: one contiguous run of each of its slices per device. Saving moves each slice's moment as a 1-D
tensor split (HDim 0, uneven) over the devices holding its pieces, in the same fused BSR; loading reads
just this device's pieces (``DeviceProgram.moment_pieces()``). So either side may use ZeRO-1 or not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import re
import uuid
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from runtime.torchfree.comm.gradsync import runs
from runtime.torchfree.elastic.state import MOMENT_SUFFIXES, STATE_DTYPE, STATE_SUFFIXES, moment_key
from runtime.torchfree.errors import HspmdError, Problem, SpecError
from runtime.torchfree.hf_files import copy_side_files
from runtime.torchfree.models.params import llama_parameters, router_bias_names, router_biases
from runtime.torchfree.spec import ModelSpec, PlanContext
from runtime.torchfree.spec.catalog import model_source_config
from runtime.torchfree.spec.hf import CONFIG_FILE, HF_NAMES, config_for, read_config, spec_from_config
from runtime.torchfree.spec.hf_moe import hf_view
from runtime.torchfree.spec.io import AtomicFiles, is_dir

if TYPE_CHECKING:
    import torch

CHECKPOINT_FILE = "checkpoint.safetensors"  # the older single-file format (read, no longer written)
FORMAT = "hspmd-checkpoint/1"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_FORMAT = "hspmd-optimizer/1"
SHARD_BYTES = 4 * 2**30  # weights above this go into several files (Hugging Face's sharded layout)
ROUND_BYTES = 256 * 2**20  # full-tensor bytes gathered per BSR round (bounds the writer's memory)
FLOATING_DTYPES = ("F", "BF")  # safetensors dtype names of floating-point tensors (F32, F8_E4M3, BF16, ...)
SAVE_ID = "hspmd_save"  # metadata key tying the files of one save together
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
STAGED = re.compile(r"\.(.+)\.\w{8}\.tmp")  # a file AtomicFiles staged (.NAME.XXXXXXXX.tmp) that a crash left
# A step count in metadata: ASCII digits (str.isdigit also takes '²', which int() refuses), at most
# MAX_STEP: the step travels as a float tensor in the optimizer state, exact up to 2**53.
STEP_TEXT = re.compile(r"[0-9]{1,16}")
MAX_STEP = 2**53
# Tensors that Hugging Face checkpoints may carry besides the parameters (buffers, the tied head's copy).
IGNORED = re.compile(r"(.*\.rotary_emb\.inv_freq)")

LATEST = "latest"  # in a directory of step checkpoints (runtime/checkpoint_series.py): names the newest
STEP_DIR = re.compile(r"step-([0-9]{8})")

Kind = Literal["hspmd", "huggingface", "legacy"]


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path  # the directory
    step: int
    model: str
    saved_by: str  # plan file and strategy that wrote it (informational)
    kind: Kind
    files: Mapping[str, Path]  # tensor name -> the file holding it (parameters; moments when ``moments``)
    moments: bool  # False: weights only, AdamW starts from zero moments


def expected_tensors(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``model`` holds, with its full shape, in module order."""
    return {info.name + suffix: info.shape for info in llama_parameters(model) for suffix in STATE_SUFFIXES}


def checkpoint_path(directory: str | Path) -> Path:
    """The older format's single file."""
    return Path(directory) / CHECKPOINT_FILE


def _header(path: Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]], list[Problem]]:
    """A file's metadata, its tensors' shapes, and a problem per tensor that is not floating point: loading
    converts to the fp32 master dtype, which would turn integers or booleans into weights silently."""
    from safetensors import SafetensorError, safe_open

    if not _utf8(path):
        raise HspmdError(f"{path}: the path is not valid UTF-8, and safetensors opens only UTF-8 paths; rename "
                         "the directory")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            problems = [Problem(str(path), k, f"has dtype {s.get_dtype()}, expected a floating-point dtype "
                                              "(F32, BF16, F16, ...)")
                        for k, s in slices.items() if not s.get_dtype().startswith(FLOATING_DTYPES)]
            return dict(f.metadata() or {}), {k: tuple(s.get_shape()) for k, s in slices.items()}, problems
    except (SafetensorError, OSError) as exc:
        raise HspmdError(f"{path}: not a readable safetensors file: {exc}") from None


def _is_file(path: Path) -> bool:
    """Whether the checkpoint has file ``path``. Something else under that name (a directory, a broken or
    looping symlink) is refused: read as absent, an unreadable optimizer file would load the weights with
    zero moments at step 0, and the other files' absence would be reported instead of what is there."""
    if path.is_file():
        return True
    if not os.path.lexists(path):
        return False
    what = "a directory" if path.is_dir() else "a broken or looping symbolic link"
    raise SpecError([Problem(str(path), "", f"is {what}, expected a file")])


def _weight_files(directory: Path) -> list[Path] | None:
    """The weight files of a Hugging Face directory (from the index when sharded), or None."""
    index = directory / WEIGHTS_INDEX
    if _is_file(index):
        data = read_config(index)
        wmap = data.get("weight_map")
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise SpecError([Problem(str(index), "weight_map", "expected an object of tensor name -> file name")])
        files = []
        for name in sorted(set(wmap.values())):
            f = directory / name
            if Path(name).name != name or not f.is_file():
                raise SpecError([Problem(str(index), "weight_map", f"names {name!r}, not a file in {directory}")])
            files.append(f)
        return files
    single = directory / WEIGHTS_FILE
    return [single] if _is_file(single) else None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint ``root/latest`` names, or None when ``root`` has no ``latest`` yet. A
    ``latest`` that names no step directory of ``root`` is an error naming it."""
    root = Path(root)
    path = root / LATEST
    if not os.path.lexists(path):
        return None
    try:
        name = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([Problem(str(path), "", f"cannot read: {getattr(exc, 'strerror', None) or exc}")]) from None
    if not STEP_DIR.fullmatch(name):
        raise SpecError([Problem(str(path), "", "expected a step directory name (step-<8 digits>), got "
                                                f"{name[:40]!r}")])
    if not (root / name).is_dir():
        raise SpecError([Problem(str(path), "", f"names {name}, which is not a directory of {root}")])
    return root / name



def resolve_checkpoint(directory: str | Path) -> Path:
    """``directory`` itself, or the checkpoint its ``latest`` names when it holds a run's step checkpoints."""
    latest = latest_checkpoint(directory)
    return Path(directory) if latest is None else latest


def optimizer_tensors(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """What ``optimizer.safetensors`` holds besides its metadata: every parameter's AdamW moments and, under
    aux-loss-free balancing, every router's bias (training state that a Hugging Face model has no place for)."""
    out = {info.name + s: info.shape for info in llama_parameters(model) for s in MOMENT_SUFFIXES}
    if model.moe is not None:
        out.update(dict.fromkeys(router_biases(model), (model.moe.num_experts,)))
    return out


def read_checkpoint_info(directory: str | Path, plan: PlanContext) -> CheckpointInfo:
    """Check that ``directory`` holds a checkpoint that ``plan``'s model can load (reads headers only)."""
    return checkpoint_info(directory, plan.model)


def checkpoint_info(directory: str | Path, model: ModelSpec, *, option: str = "--load") -> CheckpointInfo:
    """Check that ``directory`` holds a checkpoint of ``model`` (reads headers only); ``option``: the
    command-line option that named it, for the messages."""
    _check_source(Path(directory), option)
    directory = resolve_checkpoint(directory)
    weights = _weight_files(directory)
    if weights is None:
        if _is_file(checkpoint_path(directory)):
            return _legacy_info(directory, model)
        raise HspmdError(f"{directory}: {option}: no checkpoint in this directory ({WEIGHTS_FILE}, {WEIGHTS_INDEX} "
                         f"or {CHECKPOINT_FILE} not found)")
    problems: list[Problem] = []
    if _is_file(directory / CONFIG_FILE):
        problems.extend(_config_problems(directory / CONFIG_FILE, model))
    params = {info.name: info.shape for info in llama_parameters(model)}
    files: dict[str, Path] = {}
    ids: dict[Path, str | None] = {}
    if _is_file(directory / WEIGHTS_INDEX):
        index_meta = read_config(directory / WEIGHTS_INDEX).get("metadata")
        save_id = index_meta.get(SAVE_ID) if isinstance(index_meta, dict) else None
        if save_id is not None and not isinstance(save_id, str):
            problems.append(Problem(str(directory / WEIGHTS_INDEX), f"metadata.{SAVE_ID}",
                                    f"expected a save id (a string), got {type(save_id).__name__}"))
        else:
            ids[directory / WEIGHTS_INDEX] = save_id
    for path in weights:
        meta, shapes, bad_dtypes = _header(path)
        problems += bad_dtypes
        ids[path] = meta.get(SAVE_ID)
        for name, shape in shapes.items():
            if name in params:
                if name in files:  # which copy would load is an accident of file order
                    problems.append(Problem(str(path), name, f"also in {files[name].name}; a tensor belongs to "
                                                             "one file"))
                files[name] = path
                if shape != params[name]:
                    problems.append(Problem(str(path), name, f"has shape {list(shape)}, model {model.name} needs "
                                                             f"{list(params[name])}"))
            elif not (IGNORED.fullmatch(name) or name == "lm_head.weight" and model.tie_word_embeddings):
                problems.append(Problem(str(path), name, f"unexpected tensor (model {model.name} has no such "
                                                         "parameter)"))
    problems += [Problem(str(weights[0]), n, f"missing (model {model.name} needs it)") for n in params
                 if n not in files]
    step, saved_by, moments = 0, "", False
    opt = directory / OPTIMIZER_FILE
    if _is_file(opt):
        meta, shapes, bad_dtypes = _header(opt)
        problems += bad_dtypes
        ids[opt] = meta.get(SAVE_ID)
        state = optimizer_tensors(model)
        problems.extend(_state_problems(opt, meta, shapes, state, OPTIMIZER_FORMAT, model))
        files.update(dict.fromkeys(state, opt))
        step = _step(meta) or 0
        saved_by, moments = meta.get("saved_by", ""), True
    if len(set(ids.values())) > 1:
        problems.append(Problem(str(directory), "", "holds files of different saves ("
                                + ", ".join(f"{p.name}: {i or 'none'}" for p, i in ids.items())
                                + "); a save was interrupted: save again or load an intact copy"))
    if problems:
        raise SpecError(problems)
    return CheckpointInfo(directory, step, model.name, saved_by, "hspmd" if moments else "huggingface", files,
                          moments)


def _check_source(directory: Path, option: str) -> None:
    if not is_dir(directory):
        what = "not a directory" if os.path.lexists(directory) and not directory.is_symlink() else "no such directory"
        raise HspmdError(f"{directory}: {option}: {what}")


def _config_problems(path: Path, model: ModelSpec) -> list[Problem]:
    """The checkpoint's config.json must describe the plan's model (names aside)."""
    try:
        theirs = spec_from_config(read_config(path), str(path), model.name)
    except SpecError as err:
        return list(err.problems)
    model = hf_view(model)  # what config.json cannot say is not compared
    out: dict[str, Problem] = {}
    for f in dataclasses.fields(ModelSpec):
        if f.name != "name" and getattr(theirs, f.name) != getattr(model, f.name):
            key = "model_type" if f.name in ("family", "qkv_bias", "qk_norm") else HF_NAMES.get(f.name, f.name)
            out.setdefault(key, Problem(str(path), key, f"{getattr(theirs, f.name)!r} differs from the plan's model "
                                                        f"{model.name} ({f.name}: {getattr(model, f.name)!r})"))
    return list(out.values())


def _state_problems(path: Path, meta: dict[str, str], shapes: dict[str, tuple[int, ...]],
                    want: dict[str, tuple[int, ...]], fmt: str, model: ModelSpec) -> list[Problem]:
    problems = []
    if meta.get("format") != fmt:
        problems.append(Problem(str(path), "metadata.format", f"expected {fmt!r}, got {meta.get('format')!r}"))
    if _step(meta) is None:
        got = repr(meta.get("step"))
        got = got if len(got) <= 40 else f"{got[:30]}... ({len(got)} characters)"
        problems.append(Problem(str(path), "metadata.step", f"expected a step count, got {got}"))
    for name, shape in want.items():
        if name not in shapes:
            problems.append(Problem(str(path), name, f"missing (model {model.name} needs it)"))
        elif shapes[name] != shape:
            problems.append(Problem(str(path), name, f"has shape {list(shapes[name])}, model {model.name} needs "
                                                     f"{list(shape)} (saved for model {meta.get('model')!r})"))
    problems += [Problem(str(path), name, f"unexpected tensor (model {model.name} has no such state)")
                 for name in shapes if name not in want]
    return problems


def _step(meta: dict[str, str]) -> int | None:
    """The step count a file's metadata records, or None when it records none that is valid."""
    text = meta.get("step", "")
    return int(text) if STEP_TEXT.fullmatch(text) and int(text) <= MAX_STEP else None


def _legacy_info(directory: Path, model: ModelSpec) -> CheckpointInfo:
    path = checkpoint_path(directory)
    meta, shapes, bad_dtypes = _header(path)
    want = expected_tensors(model)
    problems = bad_dtypes + _state_problems(path, meta, shapes, want, FORMAT, model)
    if problems:
        raise SpecError(problems)
    return CheckpointInfo(directory, _step(meta) or 0, meta.get("model", ""), meta.get("saved_by", ""), "legacy",
                          dict.fromkeys(want, path), True)


def save_checkpoint(program: Any, groups: Any, directory: str | Path, *, plan: PlanContext, strategy: str,
                    step: int, shard_bytes: int = SHARD_BYTES) -> None:
    """Collective over every device of ``strategy``: write ``directory`` (config, weights, optimizer) in
    place (``hspmd train --save`` writes step directories instead: runtime/checkpoint_series.py)."""
    full: dict[str, torch.Tensor] = {}
    if not gather_state(program, groups, plan=plan, strategy=strategy, emit=full.__setitem__):
        return
    params = llama_parameters(plan.model)
    weights = {p.name: full.pop(p.name) for p in params}
    write_checkpoint(directory, plan.model, weights, moments=full, step=step, saved_by=saved_by(plan, strategy),
                     source_config=source_config(plan), shard_bytes=shard_bytes)
    source = model_dir(plan)
    if source is not None:   # the tokenizer and generation config of the model directory travel with it
        copy_side_files(source, Path(directory))


def model_dir(plan: PlanContext) -> Path | None:
    """The Hugging Face directory the plan's model comes from, or None (a model file or a catalog name)."""
    source = model_source_config(plan.plan.model, plan.path.parent)
    return None if source is None else source.parent


def saved_by(plan: PlanContext, strategy: str) -> str:
    return f"{plan.path} (strategy {strategy})"


def source_config(plan: PlanContext) -> dict[str, Any] | None:
    """The config.json the plan's model came from (its keys are kept in the saved config), or None."""
    source = model_source_config(plan.plan.model, plan.path.parent)
    return None if source is None else read_config(source)


def gather_state(program: Any, groups: Any, *, plan: PlanContext, strategy: str,
                 emit: Callable[[str, torch.Tensor], None]) -> bool:
    """Collective over every device of ``strategy``: assemble every parameter and AdamW moment whole on the
    strategy's first device (the writer), a bounded number of bytes per BSR round, and hand each to
    ``emit`` there as soon as it is complete (a CPU tensor the caller may keep: never the live state).
    Returns whether this device is the writer."""
    import torch

    from runtime.comm.execute import run_bsr
    from runtime.torchfree.annotations import Annotation
    from runtime.torchfree.annotations.from_plan import annotate_strategy
    from runtime.torchfree.comm.bsr import TensorMove, plan_bsr
    from runtime.torchfree.engine.zero import moment_pieces, strategy_zero_slices

    strat = plan.strategy(strategy)
    me = groups.my_device
    writer = min(strat.devices)
    local = dict(program.local_state())
    ann = annotate_strategy(strat, plan.model, plan.plan.training)
    params = ann.params
    _check_local_regions(program, {p.name: p for p in params}, me)
    slices = strategy_zero_slices(ann, plan.plan.training, plan.cluster)
    if slices and program.moment_pieces() != moment_pieces(slices, me):
        raise RuntimeError(f"device {me}: the program's ZeRO-1 moment pieces differ from the plan's")
    dtype = getattr(torch, STATE_DTYPE.name)
    moves = []
    for p in params:
        for suffix in STATE_SUFFIXES:
            if suffix and p.name in slices:
                moves.extend(_zero_moves(p.name, suffix, slices[p.name], writer, dtype, me, local))
                continue
            moves.append(TensorMove(p.name + suffix, p.shape, dtype, p.param, Annotation.spmd([writer])))
    # Aux-loss-free balancing: each router's bias, the same on every holder of the router (its parameter's layout).
    biases = router_biases(plan.model)
    if biases:
        local.update(program.router_biases())
        router = {p.name: p.param for p in params}
        shape = (plan.model.moe.num_experts,) if plan.model.moe is not None else ()
        moves += [TensorMove(n, shape, dtype, router[info.name], Annotation.spmd([writer]))
                  for n, info in biases.items()]
    for name in (m.name for m in moves if m.name in local):
        if local[name].dtype != dtype:
            raise RuntimeError(f"{name}: local state is {local[name].dtype}, checkpoints hold {dtype}")
    # A ZeRO-1 moment arrives as slices: each is assembled whole, then emitted, then dropped.
    partial: dict[str, tuple[torch.Tensor, set[int]]] = {}
    slice_of = {moment_key(p.name, s, i): (p, s, i) for p in params if p.name in slices
                for s in MOMENT_SUFFIXES for i in range(len(slices[p.name]))}
    for chunk in runs(moves, lambda m: m.itemsize * math.prod(m.shape), ROUND_BYTES):
        got = run_bsr(plan_bsr(chunk, bandwidth=plan.cluster),
                      {m.name: local[m.name] for m in chunk if m.name in local}, groups)
        if me != writer:
            continue
        for key, value in got.items():
            host = value.detach().to("cpu", copy=True)  # a copy: the state moves on while it is written
            if key not in slice_of:
                emit(key, host)
                continue
            p, suffix, i = slice_of[key]
            whole, seen = partial.setdefault(p.name + suffix, (torch.empty(p.shape, dtype=dtype), set()))
            s = slices[p.name][i]
            whole[tuple(slice(a, b) for a, b in s.region)] = host.view(s.shape)
            seen.add(i)
            if len(seen) == len(slices[p.name]):
                emit(p.name + suffix, partial.pop(p.name + suffix)[0])
    if partial:
        raise RuntimeError(f"ZeRO-1 moments incomplete after the gather: {sorted(partial)[:3]}")
    return me == writer


def write_checkpoint(directory: str | Path, model: ModelSpec, weights: Mapping[str, torch.Tensor], *,
                     moments: Mapping[str, torch.Tensor] | None, step: int, saved_by: str,
                     source_config: dict[str, Any] | None = None, shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Write a Hugging Face directory (and the optimizer file when ``moments`` is given); return the paths
    written. Files of an earlier save that this one does not replace are removed last."""
    from safetensors.torch import save

    directory = Path(directory)
    dtypes = {str(t.dtype).removeprefix("torch.") for t in weights.values()}
    if len(dtypes) != 1:
        raise ValueError(f"weights of mixed dtypes {sorted(dtypes)}")
    save_id = uuid.uuid4().hex
    meta = {"format": "pt", SAVE_ID: save_id, "step": str(step), "model": model.name}
    shards = runs(list(weights), lambda k: weights[k].numel() * weights[k].element_size(), shard_bytes)
    names = [WEIGHTS_FILE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                     for i in range(len(shards))]
    created = [p for p in (directory, *directory.parents) if not os.path.lexists(p)]
    written: list[Path] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Every file is staged before any is renamed: a failure part-way leaves the previous save whole.
        with AtomicFiles() as staged:
            for name, keys in zip(names, shards):
                staged.write(directory / name, save({k: weights[k].contiguous() for k in keys}, metadata=meta))
                written.append(directory / name)
            if moments is not None:
                opt_meta = {**meta, "format": OPTIMIZER_FORMAT, "saved_by": saved_by}
                staged.write(directory / OPTIMIZER_FILE, save(dict(moments), metadata=opt_meta))
                written.append(directory / OPTIMIZER_FILE)
            # A training checkpoint's config.json is the model's Hugging Face view: the routers' biases of
            # aux-loss-free balancing travel in the optimizer file; a weights-only export refuses them.
            config = config_for(model if moments is None else hf_view(model), dtypes.pop(), source_config)
            staged.write(directory / CONFIG_FILE, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
            written.append(directory / CONFIG_FILE)
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in weights.values()),
                                      SAVE_ID: save_id},
                         "weight_map": {k: n for n, keys in zip(names, shards) for k in keys}}
                staged.write(directory / WEIGHTS_INDEX, (json.dumps(index, indent=2) + "\n").encode())
                written.append(directory / WEIGHTS_INDEX)
        keep = {p.name for p in written}
        ours = {WEIGHTS_FILE, WEIGHTS_INDEX, OPTIMIZER_FILE, CHECKPOINT_FILE, CONFIG_FILE}

        def is_ours(name: str) -> bool:
            return name in ours or SHARD_NAME.fullmatch(name) is not None

        for old in directory.iterdir():
            staged_by_a_crash = STAGED.fullmatch(old.name)
            if (is_ours(old.name) and old.name not in keep) or (staged_by_a_crash and is_ours(staged_by_a_crash[1])):
                old.unlink()
    except OSError as exc:
        for p in created:  # what this save created, now empty again (its staged files are gone)
            with contextlib.suppress(OSError):
                p.rmdir()
        raise HspmdError(f"{directory}: cannot write the checkpoint: {exc.strerror or exc}") from None
    return written


def check_load_and_save(ctx: PlanContext, load_dir: Path | None, save_dir: Path | None) -> None:
    """What ``--load`` and ``--save`` name, checked before anything trains (by every launcher: hspmd's own
    and each torchrun worker): a bad one would otherwise surface in the workers, or after the whole run."""
    if load_dir is not None:
        read_checkpoint_info(load_dir, ctx)
    if save_dir is not None:
        check_save_target(save_dir, "--save")


def check_save_target(directory: str | Path, option: str) -> None:
    """Refuse a directory a checkpoint cannot be written to, before any work: a run trains for its whole
    length before it saves. (Mode bits are as the OS reports them: root writes through them.)"""
    directory = Path(directory)
    try:
        os.lstat(directory)
    except OSError as exc:   # a name too long, which only the save itself met before (the rest: below)
        if exc.errno == errno.ENAMETOOLONG:
            raise HspmdError(f"{directory}: {option}: cannot write: {exc.strerror}") from None
    if os.path.lexists(directory) and not directory.is_dir():
        raise HspmdError(f"{directory}: {option}: exists and is not a directory")
    existing = next(p for p in (directory, *directory.absolute().parents) if os.path.lexists(p))
    if not existing.is_dir():
        raise HspmdError(f"{directory}: {option}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise HspmdError(f"{directory}: {option}: {existing} is not writable")
    if not _utf8(directory):
        raise HspmdError(f"{directory}: {option}: the path is not valid UTF-8, and safetensors opens only UTF-8 "
                         "paths: the checkpoint could not be loaded")


def _utf8(path: Path) -> bool:
    try:
        str(path.absolute()).encode("utf-8")  # undecodable bytes of a name are lone surrogates here
    except UnicodeEncodeError:
        return False
    return True


def load_checkpoint(program: Any, directory: str | Path, plan: PlanContext) -> int:
    """Load this device's shards of every parameter and AdamW moment; return the steps already done."""
    import torch
    from safetensors import safe_open

    info = read_checkpoint_info(directory, plan)
    dtype = getattr(torch, STATE_DTYPE.name)
    state: dict[str, torch.Tensor] = {}
    pieces = program.moment_pieces() if plan.plan.training.zero else {}
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}

        def source(key: str) -> Any:
            path = info.files[key]
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            return opened[path].get_slice(key)

        for name, shard in program.param_annotations().items():
            state[name] = source(name)[shard.region].to(dtype).contiguous()
            for suffix in MOMENT_SUFFIXES:
                if name in pieces:  # ZeRO-1: only this device's pieces of the moment
                    regions = [(tuple(slice(a, b) for a, b in p.region), p.start, p.stop) for p in pieces[name]]
                    if info.moments:
                        src = source(name + suffix)
                        state[name + suffix] = torch.cat([src[r].reshape(-1)[a:b] for r, a, b in regions])
                    else:
                        state[name + suffix] = torch.zeros(sum(b - a for _, a, b in regions), dtype=dtype)
                elif info.moments:
                    state[name + suffix] = source(name + suffix)[shard.region].to(dtype).contiguous()
                else:
                    state[name + suffix] = torch.zeros_like(state[name])
        # The routers' biases of aux-loss-free balancing (optimizer_tensors); a Hugging Face checkpoint has
        # none: they start at zero, as the moments do.
        balancing = info.kind == "hspmd" and router_biases(plan.model)
        biases = {n: source(n)[:] for n in program.router_biases()} if balancing else {}
    state["step"] = torch.tensor(float(info.step))
    program.load_local_state(state)
    if biases:
        program.load_router_biases(biases)
    return info.step


def _zero_moves(name: str, suffix: str, slices: Any, writer: int, dtype: Any, me: int,
                local: dict[str, Any]) -> list[Any]:
    """A ZeRO-1 moment as one 1-D tensor per slice (``moment_key``), split over the devices that keep its
    pieces; this device's local pieces are put into ``local`` under those names."""
    from runtime.torchfree.annotations import Annotation, DistributedStates
    from runtime.torchfree.comm.bsr import TensorMove

    key = name + suffix
    mine = local.pop(key, None)
    off = 0
    moves = []
    for i, s in enumerate(slices):
        # Each element from one of its holders (with r >= 2 copies, each sends its share of its chunk).
        owners = s.senders()
        src = Annotation.union(0, [((d,), DistributedStates.of()) for d, _ in owners], [b - a for _, (a, b) in owners])
        moves.append(TensorMove(moment_key(name, suffix, i), (s.numel,), dtype, src, Annotation.spmd([writer])))
        if me in s.devices:
            a, b = s.chunk(me)
            x, y = s.part(me)
            if y > x:
                local[moment_key(name, suffix, i)] = mine[off + x - a:off + y - a]
            off += b - a
    if mine is not None and off != mine.numel():
        raise RuntimeError(f"{key}: device {me} keeps {mine.numel()} ZeRO-1 moment elements, its pieces {off}")
    return moves


def _check_local_regions(program: Any, params: dict[str, Any], me: int) -> None:
    """The engine's own view of what it holds must match the plan's annotations, or the BSR would move
    the wrong slices."""
    for name, shard in program.param_annotations().items():
        region = tuple((s.start, s.stop) for s in shard.region)
        expected = params[name].param.layout(params[name].shape).region(me)
        if region != expected:
            raise RuntimeError(f"{name}: device {me} holds region {region}, the plan's annotation says {expected}")


def read_saved(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a saved checkpoint (parameters, and moments when it has them) in full, and the
    metadata of the file that records the step: for tests and ``hspmd export``, not for training."""
    from safetensors import safe_open

    directory = resolve_checkpoint(directory)
    weights = _weight_files(directory)
    files = [checkpoint_path(directory)] if weights is None else weights
    if weights is not None and _is_file(directory / OPTIMIZER_FILE):
        files.append(directory / OPTIMIZER_FILE)
    out: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if not IGNORED.fullmatch(k)})
            meta = dict(f.metadata() or {})  # the last file's: the optimizer's (step, saved_by) when present
    return out, meta


EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export_checkpoint(source: str | Path, out: str | Path, *, dtype: str = "fp32",
                      model_ref: str | None = None) -> list[Path]:
    """Write checkpoint ``source`` (either format) as a weights-only Hugging Face directory ``out`` with
    weights in ``dtype`` (a key of EXPORT_DTYPES). The model is ``source``'s config.json, else
    ``model_ref``, else the catalog entry the older format's metadata names. Checks everything first."""
    import torch

    from runtime.torchfree.spec import load_model
    from runtime.torchfree.spec.hf import load_hf_model

    source, out = Path(source), Path(out)
    _check_source(source, "--checkpoint")
    source = resolve_checkpoint(source)
    check_save_target(out, "--out")
    if out.exists() and out.resolve() == source.resolve():
        raise HspmdError(f"{out}: --out: is the checkpoint itself; export into another directory")
    config = None
    if model_ref is not None:
        model = load_model(model_ref, file="--model", field="")
        path = model_source_config(model_ref)
        config = None if path is None else read_config(path)
    elif _is_file(source / CONFIG_FILE):
        model = load_hf_model(source)
        config = read_config(source / CONFIG_FILE)
    elif _is_file(checkpoint_path(source)):
        name = _header(checkpoint_path(source))[0].get("model", "")
        model = load_model(name, file=str(checkpoint_path(source)), field="metadata.model")
    elif _weight_files(source) is not None:
        raise HspmdError(f"{source}: --checkpoint: no {CONFIG_FILE} to say which model its weights are; name it "
                         "with --model")
    else:
        raise HspmdError(f"{source}: --checkpoint: no checkpoint in this directory ({CONFIG_FILE} or "
                         f"{CHECKPOINT_FILE} not found)")
    # (A model file with bias_update_rate is refused by config_for; a checkpoint's config.json cannot say it.)
    biases = router_bias_names(model)
    if biases and _is_file(source / OPTIMIZER_FILE) and set(biases) & set(_header(source / OPTIMIZER_FILE)[1]):
        raise HspmdError(f"{source / OPTIMIZER_FILE}: moe.bias_update_rate: the checkpoint holds the routers' biases "
                         "of aux-loss-free balancing, which have no place in a Hugging Face layout (the export "
                         "would route differently)")
    info = checkpoint_info(source, model, option="--checkpoint")
    tensors, _ = read_saved(source)
    target = getattr(torch, EXPORT_DTYPES[dtype])
    weights = {i.name: tensors[i.name].to(target) for i in llama_parameters(model)}
    return write_checkpoint(out, model, weights, moments=None, step=info.step, saved_by=str(source),
                            source_config=config)
