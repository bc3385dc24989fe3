"""scripts/compare_trace.py: a measured trace lined up op by op with the simulated timeline. Its oracle: a
trace written from the simulated timeline itself must come back op for op as simulated."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PLAN = REPO / "configs" / "plans" / "cpu-hetero4-dp-pp.yaml"


def load_script():
    name = "compare_trace_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "compare_trace.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def test_a_trace_of_the_simulated_timeline_compares_equal(tmp_path, capsys):
    ct = load_script()
    step, sim = ct.simulated(PLAN, [])
    assert sim and step > 0
    names = {"F": "forward", "B": "backward", "W": "weight_grad", "opt": "optimizer"}
    events = []
    for n in range(4):   # four identical steps, one after the other
        t0 = n * step * 1e6
        for dev in {k[0] for k in sim}:
            events.append({"name": f"step {n + 1}", "cat": "step", "ph": "X", "pid": dev, "tid": 0, "ts": t0,
                           "dur": step * 1e6})
        for (dev, letter, mb, chunk), (start, dur) in sim.items():
            args = {"chunk": chunk}
            if mb >= 0:
                args["micro_batch"] = mb
            events.append({"name": names[letter], "cat": "compute", "ph": "X", "pid": dev, "tid": 0,
                           "ts": t0 + start * 1e6, "dur": dur * 1e6, "args": args})
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    meas_step, meas = ct.measured(tmp_path, 2)
    assert meas_step == pytest.approx(step)
    assert set(meas) == set(sim)
    for k, v in sim.items():
        assert meas[k] == pytest.approx(v, abs=1e-9)
    assert ct.main(["--plan", str(PLAN), "--trace", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(r["meas_ms"] == pytest.approx(r["sim_ms"]) for r in out["ops"])
    assert {(t["device"], t["op"]) for t in out["totals"]} >= {(d, "F") for d, *_ in sim}
