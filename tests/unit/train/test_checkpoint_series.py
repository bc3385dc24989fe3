"""Step checkpoints: the streaming writer (files safetensors reads, host memory bounded by one tensor), the
series' ``latest`` and ``--keep``, and a writer killed mid-save leaving ``latest`` on a complete checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from runtime.checkpoint import LATEST, checkpoint_info, latest_checkpoint, read_saved
from runtime.checkpoint_series import SaveRequest, TrainerState, begin, read_trainer_state, step_dirs, write_snapshot
from runtime.checkpoint_stream import StreamingCheckpoint
from runtime.torchfree.errors import SpecError
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import load_model

REPO = Path(__file__).resolve().parents[3]
MODEL = load_model("llama-tiny", file="test", field="model")


def layout(n: int, shape: tuple[int, ...]) -> dict:
    return {"a.safetensors": ({f"t{i}": (shape, "float32") for i in range(n)}, {"step": "3"})}


def test_streamed_files_read_back_whatever_the_arrival_order(tmp_path):
    shapes = {"t0": (3, 5), "t1": (7,), "t2": (2, 2, 2)}
    files = {"x.safetensors": ({k: (s, "float32") for k, s in shapes.items()}, {"note": "hi"}),
             "y.safetensors": ({"b": ((4,), "bfloat16")}, {})}
    want = {k: torch.randn(s) for k, s in shapes.items()}
    want["b"] = torch.randn(4).to(torch.bfloat16)
    stream = StreamingCheckpoint(tmp_path, files)
    for k in ("t2", "b", "t0", "t1"):
        stream.put(k, want[k])
    stream.close()
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert f.metadata() == {"note": "hi"}
        assert all(torch.equal(f.get_tensor(k), want[k]) for k in shapes)
    with safe_open(tmp_path / "y.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("b"), want["b"])


def test_a_tensor_that_never_came_or_does_not_fit_is_refused(tmp_path):
    stream = StreamingCheckpoint(tmp_path, layout(2, (4,)))
    with pytest.raises(ValueError, match="layout has float32 \\[4\\]"):
        stream.put("t0", torch.zeros(5))
    stream.put("t0", torch.zeros(4))
    with pytest.raises(ValueError, match="written twice"):
        stream.put("t0", torch.zeros(4))
    with pytest.raises(RuntimeError, match="1 tensor\\(s\\) never arrived \\(t1\\)"):
        stream.close()


def _peak(write) -> int:
    tracemalloc.start()
    try:
        write()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_writer_holds_at_most_one_tensor(tmp_path):
    """numpy's buffers are traced by tracemalloc: the tensors come from a generator that makes each as it is
    asked for, so the peak is what the writer keeps alive (plus the one in hand). The same tensors through
    safetensors' own ``save`` (the whole file's bytes at once) peak at the whole size: the measure can fail."""
    n, shape = 24, (256, 256)   # 24 tensors of 256 KiB
    one = 4 * shape[0] * shape[1]
    alive = {"now": 0, "most": 0}

    def tensors():
        for i in range(n):
            a = np.full(shape, i, dtype=np.float32)
            alive["now"] += 1
            alive["most"] = max(alive["most"], alive["now"])
            yield f"t{i}", torch.from_numpy(a)
            alive["now"] -= 1

    def stream_all():
        s = StreamingCheckpoint(tmp_path, layout(n, shape))
        for name, t in tensors():
            s.put(name, t)
            del t
        s.close()

    peak = _peak(stream_all)
    assert alive["most"] == 1
    assert peak < 2.5 * one, (peak, one)
    with safe_open(tmp_path / "a.safetensors", framework="pt") as f:
        assert float(f.get_tensor("t17")[0, 0]) == 17.0

    from safetensors.torch import save

    assert _peak(lambda: save(dict(tensors()))) > n * one


def state(step: int) -> list[tuple[str, torch.Tensor]]:
    tensors = []
    for p in llama_parameters(MODEL):
        for suffix in ("", ".exp_avg", ".exp_avg_sq"):
            tensors.append((p.name + suffix, torch.full(p.shape, float(step))))
    return tensors


def request(root: Path, step: int, keep: int | None = None) -> SaveRequest:
    return SaveRequest(root, step, MODEL, "test", None, TrainerState(step, 0, {"step": step}, b""), {}, keep)


def test_latest_names_the_newest_and_keep_drops_the_oldest(tmp_path):
    root = tmp_path / "ck"
    for step in (2, 4, 6):
        write_snapshot(request(root, step, keep=2), state(step))
    assert [p.name for p in step_dirs(root)] == ["step-00000004", "step-00000006"]
    assert latest_checkpoint(root) == root / "step-00000006"
    info = checkpoint_info(root, MODEL)   # a --save directory loads as its latest
    assert info.step == 6 and info.moments
    tensors, _ = read_saved(root)
    assert all(float(t.flatten()[0]) == 6.0 for t in tensors.values())
    assert read_trainer_state(root / "step-00000006").data == {"step": 6}


def test_a_latest_that_names_nothing_is_one_line(tmp_path):
    (tmp_path / LATEST).write_text("step-00000009\n")
    with pytest.raises(SpecError, match="names step-00000009, which is not a directory"):
        latest_checkpoint(tmp_path)
    (tmp_path / LATEST).write_text("../elsewhere\n")
    with pytest.raises(SpecError, match="expected a step directory name"):
        latest_checkpoint(tmp_path)


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from runtime.checkpoint_series import write_snapshot
    from runtime.checkpoint_stream import StreamingCheckpoint
    from tests.unit.train.test_checkpoint_series import request, state

    slow_put = StreamingCheckpoint.put
    def put(self, name, tensor):   # the disk is slow: the kill lands while tensors are being written
        slow_put(self, name, tensor)
        print("wrote", name, flush=True)
        time.sleep(0.05)
    StreamingCheckpoint.put = put
    write_snapshot(request(Path(sys.argv[1]), 8), state(8))
""")


def test_a_writer_killed_mid_save_leaves_latest_on_the_complete_previous_one(tmp_path):
    root = tmp_path / "ck"
    write_snapshot(request(root, 4), state(4))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(root)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    for _ in range(3):   # three tensors of step 8 are on disk
        assert proc.stdout.readline().startswith("wrote")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    staged = [p for p in root.iterdir() if p.name.startswith(".step-00000008.")]
    assert len(staged) == 1 and any(staged[0].iterdir())   # it was killed mid-save
    assert latest_checkpoint(root) == root / "step-00000004"
    assert checkpoint_info(root, MODEL).step == 4
    begin(root, 12)   # the next save clears what the killed one left
    assert not any(p.name.startswith(".step-00000008.") for p in root.iterdir())
