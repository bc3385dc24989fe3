"""A run's checkpoints: ``DIR/step-<8 digits>/`` each, ``DIR/latest`` naming the newest complete one.

``hspmd train --save DIR --save-every N [--keep K]`` saves every N steps and at the end. One save:

1. collective (every device of the strategy, runtime/checkpoint.py ``gather_state``): the full tensors are
   assembled on the strategy's first device, round by round, and copied to host memory there;
2. on that device, in a background thread while training goes on (torchtitan's asynchronous checkpointing
   is the model): the tensors are streamed into a fresh ``DIR/.step-<N>.<id>.tmp/`` one by one
   (runtime/checkpoint_stream.py), every file fsynced, the directory renamed to ``DIR/step-<N>/`` and
   fsynced, then ``DIR/latest`` replaced atomically, then checkpoints beyond the newest K removed.

A process killed at any point leaves ``latest`` naming a complete checkpoint (the previous one while the
new one is being written); what a killed save left (a ``.tmp`` directory) is removed by the next save. The
next save waits for the previous one's thread first, so at most one snapshot is held besides the training
state. ``--save-every 0`` (or a run's last step) saves synchronously: the writer streams each BSR round to
disk as it arrives, holding one round, not the whole state.

Besides the model's files (runtime/checkpoint.py) a step directory holds ``trainer_state.json``: the step,
the data's position and seed, and the torch random state, so that ``--resume`` continues exactly.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.checkpoint import (
    CONFIG_FILE,
    LATEST,
    OPTIMIZER_FILE,
    OPTIMIZER_FORMAT,
    SAVE_ID,
    SHARD_BYTES,
    STATE_DTYPE,
    STEP_DIR,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    gather_state,
    model_dir,
    optimizer_tensors,
    saved_by,
    source_config,
)
from runtime.checkpoint_stream import StreamingCheckpoint, fsync_dir, write_synced
from runtime.torchfree.errors import HspmdError, Problem, SpecError
from runtime.torchfree.hf_files import copy_side_files
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import ModelSpec, PlanContext
from runtime.torchfree.spec.hf import config_for
from runtime.torchfree.spec.hf_moe import hf_view

if TYPE_CHECKING:
    import torch

STAGING = re.compile(r"\.step-[0-9]{8}\.[0-9a-f]{32}\.tmp")
TRAINER_STATE = "trainer_state.json"
TRAINER_FORMAT = "hspmd-trainer/1"
MAX_SERIES_STEP = 10**8 - 1  # eight digits


def step_name(step: int) -> str:
    if not 0 <= step <= MAX_SERIES_STEP:
        raise ValueError(f"step {step} does not fit step-<8 digits>")
    return f"step-{step:08d}"


def step_of(checkpoint: Path) -> int:
    m = STEP_DIR.fullmatch(checkpoint.name)
    if m is None:
        raise ValueError(f"{checkpoint}: not a step directory")
    return int(m[1])


def step_dirs(root: Path) -> list[Path]:
    """The step directories of ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir()), key=step_of)


# ---------------------------------------------------------------------------------------------------------
# What a step directory holds


@dataclass(frozen=True)
class TrainerState:
    """What besides the model and optimizer a run needs to continue exactly: the step done, the data's
    position (``data``: the source's own description, e.g. epoch and offset) and seed, and the torch random
    state of the saving device (restored on every device on resume)."""

    step: int
    seed: int
    data: Mapping[str, Any]
    rng: bytes

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"step must not be negative, got {self.step}")

    def to_json(self) -> str:
        return json.dumps({"format": TRAINER_FORMAT, "step": self.step, "seed": self.seed, "data": dict(self.data),
                           "torch_rng_state": base64.b64encode(self.rng).decode()}, indent=2) + "\n"


def read_trainer_state(checkpoint: Path) -> TrainerState | None:
    """A step directory's trainer state (None for a checkpoint without one: ``--load`` of a plain save)."""
    from runtime.torchfree.spec.hf import read_config

    path = checkpoint / TRAINER_STATE
    if not path.is_file():
        return None
    raw = read_config(path)

    def bad(field: str, what: str) -> SpecError:
        return SpecError([Problem(str(path), field, what)])

    if raw.get("format") != TRAINER_FORMAT:
        raise bad("format", f"expected {TRAINER_FORMAT!r}, got {raw.get('format')!r}"[:200])
    step, seed, data, rng = raw.get("step"), raw.get("seed"), raw.get("data"), raw.get("torch_rng_state")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise bad("step", f"expected a step count, got {step!r}"[:200])
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise bad("seed", f"expected an integer, got {seed!r}"[:200])
    if not isinstance(data, dict):
        raise bad("data", "expected an object")
    try:
        state = base64.b64decode(rng if isinstance(rng, str) else "", validate=True)
    except ValueError:
        raise bad("torch_rng_state", "expected base64 text") from None
    return TrainerState(step, seed, data, state)


def stream_files(model: ModelSpec, *, step: int, saved: str, save_id: str, shard_bytes: int = SHARD_BYTES
                 ) -> tuple[dict[str, tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, str]]], dict | None]:
    """The safetensors files of a checkpoint of ``model`` (for ``StreamingCheckpoint``), and the weights
    index when they are sharded (Hugging Face's layout, as ``write_checkpoint`` writes)."""
    from runtime.torchfree.comm.gradsync import runs

    dtype = STATE_DTYPE.name
    params = llama_parameters(model)
    meta = {"format": "pt", SAVE_ID: save_id, "step": str(step), "model": model.name}
    nbytes = {p.name: STATE_DTYPE.itemsize * math.prod(p.shape) for p in params}
    shards = runs([p.name for p in params], nbytes.__getitem__, shard_bytes)
    shapes = {p.name: tuple(p.shape) for p in params}
    names = [WEIGHTS_FILE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                     for i in range(len(shards))]
    files = {n: ({k: (shapes[k], dtype) for k in keys}, meta) for n, keys in zip(names, shards)}
    files[OPTIMIZER_FILE] = ({k: (shape, dtype) for k, shape in optimizer_tensors(model).items()},
                             {**meta, "format": OPTIMIZER_FORMAT, "saved_by": saved})
    index = None if len(shards) == 1 else {
        "metadata": {"total_size": sum(nbytes.values()), SAVE_ID: save_id},
        "weight_map": {k: n for n, keys in zip(names, shards) for k in keys}}
    return files, index


# ---------------------------------------------------------------------------------------------------------
# Writing one step directory, and the series


@dataclass(frozen=True)
class SaveRequest:
    """Everything the writer needs besides the tensors (picklable, small)."""

    root: Path
    step: int
    model: ModelSpec
    saved_by: str
    source_config: Mapping[str, Any] | None
    trainer: TrainerState
    extra: Mapping[str, bytes]  # further small files of the step directory (a documents run's dispatch state)
    keep: int | None  # keep the newest K step directories (None: all)
    shard_bytes: int = SHARD_BYTES
    model_dir: Path | None = None  # the model's Hugging Face directory: its tokenizer files travel along


def begin(root: Path, step: int) -> Path:
    """A fresh staging directory for ``step`` under ``root``; what killed saves left is removed first."""
    root.mkdir(parents=True, exist_ok=True)
    for p in root.iterdir():
        if STAGING.fullmatch(p.name):
            shutil.rmtree(p, ignore_errors=True)
    tmp = root / f".{step_name(step)}.{uuid.uuid4().hex}.tmp"
    tmp.mkdir()
    return tmp


@dataclass
class OpenSave:
    """A step directory being written: its staging directory, its tensor files, the weights index."""

    tmp: Path
    stream: StreamingCheckpoint
    index: dict | None


def open_stream(tmp: Path, req: SaveRequest) -> OpenSave:
    files, index = stream_files(req.model, step=req.step, saved=req.saved_by, save_id=uuid.uuid4().hex,
                                shard_bytes=req.shard_bytes)
    return OpenSave(tmp, StreamingCheckpoint(tmp, files), index)


def finish(save: OpenSave, req: SaveRequest) -> Path:
    """Close the tensor files, write the small ones, then make the step directory and ``latest`` durable,
    and drop the checkpoints beyond the newest ``keep``. Returns the step directory."""
    tmp = save.tmp
    save.stream.close()
    config = config_for(hf_view(req.model), STATE_DTYPE.name, dict(req.source_config) if req.source_config else None)
    small = {CONFIG_FILE: (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(),
             TRAINER_STATE: req.trainer.to_json().encode(), **req.extra}
    if save.index is not None:
        small[WEIGHTS_INDEX] = (json.dumps(save.index, indent=2) + "\n").encode()
    for name, data in small.items():
        write_synced(tmp / name, data)
    if req.model_dir is not None:
        copy_side_files(req.model_dir, tmp)
    fsync_dir(tmp)
    root = req.root
    final = root / step_name(req.step)
    if os.path.lexists(final):   # a save of this step by an earlier run (resumed from before it): replaced
        old = root / f".{step_name(req.step)}.{uuid.uuid4().hex}.tmp"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    pointer = root / f".{LATEST}.{uuid.uuid4().hex}.tmp"
    write_synced(pointer, (final.name + "\n").encode())
    os.replace(pointer, root / LATEST)
    fsync_dir(root)
    prune(root, req.keep, final)
    return final


def prune(root: Path, keep: int | None, newest: Path) -> None:
    """Remove step directories beyond the newest ``keep`` (never the one ``latest`` names)."""
    if keep is None:
        return
    for old in step_dirs(root)[:-keep]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


def write_snapshot(req: SaveRequest, tensors: list[tuple[str, torch.Tensor]]) -> Path:
    """Write a host snapshot (emptied as it is written: each tensor is freed once on disk)."""
    tmp = begin(req.root, req.step)
    try:
        save = open_stream(tmp, req)
        try:
            tensors.reverse()
            while tensors:
                name, t = tensors.pop()
                save.stream.put(name, t)
                del t
        except BaseException:
            save.stream.abort()
            raise
        return finish(save, req)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class Saver:
    """One device's side of the run's saves (the writer device writes; every device gathers)."""

    def __init__(self, root: Path, keep: int | None, report: Callable[[str], None]) -> None:
        self.root, self.keep, self.report = Path(root), keep, report
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, program: Any, groups: Any, *, plan: PlanContext, strategy: str, trainer: TrainerState,
             extra: Mapping[str, bytes] | None = None, background: bool = True) -> None:
        """Collective over the strategy's devices. ``background``: return once the state is on the host (the
        writer's thread writes it); else return once it is on disk, streamed round by round."""
        t0 = time.perf_counter()
        self.wait()   # the previous save first: at most one snapshot besides the training state
        req = SaveRequest(self.root, trainer.step, plan.model, saved_by(plan, strategy), source_config(plan),
                          trainer, dict(extra or {}), self.keep, model_dir=model_dir(plan))
        if background:
            snapshot: list[tuple[str, torch.Tensor]] = []
            if gather_state(program, groups, plan=plan, strategy=strategy,
                            emit=lambda n, t: snapshot.append((n, t))):
                paused = time.perf_counter() - t0
                self._thread = threading.Thread(target=self._write, args=(req, snapshot, paused), daemon=True,
                                                name=f"hspmd-save-{trainer.step}")
                self._thread.start()
            return
        tmp = None
        save = None
        try:
            if groups.my_device == min(plan.strategy(strategy).devices):
                tmp = begin(self.root, req.step)
                save = open_stream(tmp, req)
            writer = gather_state(program, groups, plan=plan, strategy=strategy,
                                  emit=save.stream.put if save is not None else _nothing)
            if writer and save is not None:
                self.report(f"saved {finish(save, req)} (step {req.step}; {time.perf_counter() - t0:.3f} s)")
        except OSError as exc:
            raise HspmdError(f"{self.root}: cannot write the checkpoint: {exc.strerror or exc}") from None
        finally:
            if tmp is not None and tmp.exists():   # the save failed before its rename: nothing of it stays
                if save is not None:
                    save.stream.abort()
                shutil.rmtree(tmp, ignore_errors=True)

    def _write(self, req: SaveRequest, snapshot: list[tuple[str, torch.Tensor]], paused: float) -> None:
        t0 = time.perf_counter()
        try:
            where = write_snapshot(req, snapshot)
            self.report(f"saved {where} (step {req.step}; training paused {paused:.3f} s, written in the "
                        f"background in {time.perf_counter() - t0:.3f} s)")
        except BaseException as exc:  # noqa: BLE001 - raised again by wait(), in the training thread
            self._error = exc

    def wait(self) -> None:
        """Wait for the save in flight; raise what it raised (a full disk: one line naming the directory)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if isinstance(err, OSError):
            raise HspmdError(f"{self.root}: cannot write the checkpoint: {err.strerror or err}") from None
        if err is not None:
            raise err


def _nothing(name: str, tensor: Any) -> None:
    raise RuntimeError(f"{name}: a device that does not write was handed a tensor")


def torch_rng_state() -> bytes:
    import torch

    return bytes(torch.get_rng_state().numpy().tobytes())


def restore_rng(state: bytes) -> None:
    import torch

    if state:
        torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
