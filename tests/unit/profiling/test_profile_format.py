"""The profile format: round trip, strict loading errors, and which profile wins."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runtime.torchfree.errors import SpecError
from runtime.torchfree.profiling.profile import (
    BLOCKS,
    PROFILES_DIR,
    ComponentFit,
    LinkFit,
    MeasuredModel,
    OptimizerFit,
    dump_profile,
    load_profile,
    resolve_profiles,
    save_profile,
    spec_profile,
)
from runtime.torchfree.spec import load_cluster

REPO = Path(__file__).resolve().parents[3]
SHIPPED = ("H800", "H20", "H100", "A100-80G", "A800", "L40S", "RTX4090", "RTX3090", "V100", "T4", "L4",
           "chip-a", "chip-b")


def measured(name: str = "cpu-fast"):
    comp = ComponentFit((1e-9, 2e-6, 3e-5), (2e-9, 4e-6, 6e-5), (0.0, 512.0, 0.0), params=1234, residual=0.02)
    block = ComponentFit((0.0, 1e-6, 1e-4), (0.0, 2e-6, 2e-4), (0.0, 0.0, 0.0), params=0, residual=0.05)
    blocks = {k: block for k in BLOCKS}
    mm = MeasuredModel(64, 128, 8, 4, 256, 1, (32, 64), {1: {k: comp for k in
                                                              ("embedding", "attention", "mlp", "norm", "head")}},
                       tp_overhead={2: block}, tp_blocks={2: blocks}, tp_blocks_sp={2: blocks},
                       blocks={1: blocks})
    base = spec_profile(name, peak_tflops=0.1, hbm_bandwidth_gbs=10, memory_gib=2, note="", emulated=True)
    comm = dataclasses.replace(base.comm, p2p=LinkFit(1e-3, 1.5), allreduce={2: LinkFit(2e-3, 1.0)})
    return dataclasses.replace(base, provenance="measured", comm=comm, models={"llama-tiny": mm},
                               step_overhead=OptimizerFit(1e-9, 1e-5, 2e-6), sync_pack=OptimizerFit(3e-10, 2e-6, 8e-6),
                               source=dataclasses.replace(base.source, host="box", torch_version="2.13",
                                                          date="2025-01-01"))


def test_round_trip(tmp_path: Path):
    p = measured()
    save_profile(p, tmp_path / "x.yaml")
    assert load_profile(tmp_path / "x.yaml") == p
    text = dump_profile(load_profile(tmp_path / "x.yaml"))
    (tmp_path / "y.yaml").write_text(text)
    assert dump_profile(load_profile(tmp_path / "y.yaml")) == text


def test_profile_written_before_the_new_fields_still_loads(tmp_path: Path):
    """Stage blocks, TP blocks, step overhead and sync packing are optional: a profile from before them
    loads, with no overhead."""
    data = yaml.safe_load(dump_profile(measured()))
    for key in ("step_overhead", "sync_pack"):
        data.pop(key)
    for key in ("tp_blocks", "tp_blocks_sp", "blocks"):
        data["models"]["llama-tiny"].pop(key)
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    old = load_profile(path)
    assert old.models["llama-tiny"].blocks == {} and old.models["llama-tiny"].tp_blocks_sp == {}
    assert old.step_overhead == OptimizerFit(0.0)


def test_profile_with_host_figures_loads_them_ignored_with_a_note(tmp_path: Path, capsys):
    """A profile written when hspmd modelled the CPU host of emulated devices still loads: those figures
    are dropped with one line on stderr naming the file and them; everything else is as written."""
    data = yaml.safe_load(dump_profile(measured()))
    data["compute"]["host_cores"] = 2
    data["comm"].update(p2p_wake={"forward_s": 3e-4, "backward_s": 3e-4, "tau_s": 1e-3}, shared_core_p2p_s=1.5e-3,
                        p2p_actions={"post_send_s": 2e-4, "post_recv_s": 1e-4, "wait_recv_s": 1e-4})
    data["models"]["llama-tiny"].update(resume={"forward_s": 4e-4, "backward_s": 8e-4, "tau_s": 3e-3},
                                        core_sharing={64: 0.9}, tp_blocks_cpu=data["models"]["llama-tiny"]["tp_blocks"],
                                        core_handoff={64: {"handoff_s": 1e-3, "wake_s": 0.0, "recv_wake_s": 0.0}})
    path = tmp_path / "old-host.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_profile(path) == measured()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0]
    for name in ("compute.host_cores", "comm.p2p_wake", "comm.p2p_actions", "comm.shared_core_p2p_s",
                 "models.llama-tiny.resume", "models.llama-tiny.core_sharing", "models.llama-tiny.tp_blocks_cpu",
                 "models.llama-tiny.core_handoff"):
        assert name in err[0]
    # A field of that name anywhere else is still an error, not silently dropped.
    data["memory"]["resume"] = 1
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match="memory.resume"):
        load_profile(path)


def test_every_shipped_spec_profile_loads():
    for name in SHIPPED:
        prof = load_profile(PROFILES_DIR / f"{name}.yaml")
        assert prof.device_type == name and prof.provenance == "spec" and prof.source.note
    for path in PROFILES_DIR.glob("*.yaml"):   # measured ones `hspmd profile` may have added load too
        load_profile(path)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["compute"].update(matmul_efficiency=1.5), "compute.matmul_efficiency: must be in (0, 1]"),
    (lambda d: d.update(provenance="guess"), "provenance: expected one of 'measured', 'imported', 'spec'"),
    (lambda d: d["comm"].pop("p2p_latency_s"), "comm.p2p_latency_s: missing required field"),
    (lambda d: d["models"]["llama-tiny"]["tp"][1].pop("mlp"), "models.llama-tiny.tp.1: missing component(s) mlp"),
    (lambda d: d["models"]["llama-tiny"]["tp"][1]["attention"].update(forward_s=[1, 2]),
     "models.llama-tiny.tp.1.attention.forward_s: expected a list of 3 items, got 2"),
    (lambda d: d.update(bogus=1), "bogus: unknown key"),
    (lambda d: d["models"]["llama-tiny"]["blocks"][1].pop("stage"),
     "models.llama-tiny.blocks.1: missing block(s) stage"),
])
def test_bad_field_names_file_and_field(tmp_path: Path, edit, message):
    data = yaml.safe_load(dump_profile(measured()))
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as err:
        load_profile(path)
    assert any(line.startswith(f"{path}: ") and message in line for line in err.value.lines()), err.value.lines()


def test_measured_overrides_spec_and_user_dir_wins(tmp_path: Path):
    cluster = load_cluster("hexiscale-mixed")
    ps = resolve_profiles(cluster.device_types)
    assert ps["A800"].provenance == "spec" and ps.resolved("A800").path == PROFILES_DIR / "A800.yaml"
    # A measured A800 in a user directory wins; a spec RTX4090 there also beats the shipped spec one.
    save_profile(dataclasses.replace(measured("A800"), memory_gib=80), tmp_path / "a.yaml")
    save_profile(dataclasses.replace(spec_profile("RTX4090", peak_tflops=1, hbm_bandwidth_gbs=1, memory_gib=24,
                                                  note="mine")), tmp_path / "b.yaml")
    ps = resolve_profiles(cluster.device_types, [tmp_path])
    assert ps["A800"].provenance == "measured"
    assert ps["RTX4090"].source.note == "mine"
    # A measured profile in the shipped directory still beats a spec one given first.
    other = tmp_path / "o"
    save_profile(spec_profile("cpu-fast", peak_tflops=1, hbm_bandwidth_gbs=1, memory_gib=2, note=""),
                 other / "s.yaml")
    save_profile(measured("cpu-fast"), tmp_path / "m.yaml")
    ps = resolve_profiles(["cpu-fast"], [other, tmp_path], include_shipped=False)
    assert ps["cpu-fast"].provenance == "measured"


def test_fallback_and_missing(tmp_path: Path):
    cpu = load_cluster("cpu-hetero4")
    ps = resolve_profiles(cpu.device_types, [tmp_path], include_shipped=False)
    assert ps.resolved("cpu-slow").path is None and ps["cpu-slow"].compute.peak_tflops == pytest.approx(0.0667)
    with pytest.raises(SpecError, match="no profile for device type 'cpu-slow'"):
        resolve_profiles(["cpu-slow"], [tmp_path], include_shipped=False)


def test_duplicate_in_one_dir_is_an_error(tmp_path: Path):
    save_profile(measured(), tmp_path / "a.yaml")
    save_profile(measured(), tmp_path / "b.yaml")
    with pytest.raises(SpecError, match="also in"):
        resolve_profiles(["cpu-fast"], [tmp_path])


def test_cli_bad_profile_exit_2_one_line(tmp_path: Path):
    data = yaml.safe_load(dump_profile(measured()))
    data["comm"]["bandwidth_efficiency"] = "fast"
    (tmp_path / "cpu-fast.yaml").write_text(yaml.safe_dump(data))
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "simulate", "--plan",
                           str(REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"), "--profile", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'cpu-fast.yaml'}: comm.bandwidth_efficiency: expected a number, got 'fast' (str)"]
