"""``hspmd profile import / export / show``: a flat table measured elsewhere becomes a profile whose every
point the cost model reproduces; export -> import -> export is the identity; bad rows are one line each."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hetu_cli.main import cli
from planner.cost import CostModel
from runtime.torchfree.profiling.flat_table import COLUMNS, format_rows, table_rows
from runtime.torchfree.profiling.profile import COMPONENTS, eval_fit, load_profile, save_profile
from runtime.torchfree.spec import load_model
from runtime.torchfree.spec.cluster import Cluster, DeviceType, Node

REPO = Path(__file__).resolve().parents[3]
TINY = load_model("llama-tiny")
MBS, LENS = (1, 2, 4), (64, 128, 256)


def measured_rows() -> list[dict]:
    """A table as another system's profiler writes one: every component, TP 1 and 2, a first layer that
    differs, links by size and direction, a cross-node all-reduce curve, a fixed cost per iteration."""
    rows = []
    for tp in (1, 2):
        for i, comp in enumerate(COMPONENTS):
            for b in MBS:
                for s in LENS:
                    f = (i + 1) * (2e-5 * b ** 0.85 * s / 64 + 4e-5) / tp
                    rows.append({"kind": "compute", "component": comp, "tp": tp, "micro_batch": b, "seq_len": s,
                                 "forward_s": f, "backward_s": 2.2 * f, "optimizer_s": 1e-4 * (i + 1) / tp})
    rows += [{"kind": "compute", "component": "attention", "layer": 0, "tp": 1, "micro_batch": b, "seq_len": s,
              "forward_s": 3e-4 * b * s / 64, "backward_s": 7e-4 * b * s / 64} for b in MBS for s in LENS]
    rows += [{"kind": "link", "link": "inter", "direction": d, "bytes": n,
              "bandwidth_gbs": bw * (0.8 if d == "recv" else 1)}
             for d in ("send", "recv") for n, bw in ((4096, 0.5), (1 << 20, 9.0), (1 << 24, 11.5))]
    rows += [{"kind": "allreduce", "link": "inter", "group": 2, "bytes": n, "bandwidth_gbs": bw}
             for n, bw in ((1 << 16, 1.0), (1 << 26, 10.0))]
    rows.append({"kind": "iteration", "seconds": 0.003})
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows(rows)
    path.write_text(buf.getvalue())


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def import_(tmp_path: Path, table: Path, *extra: str) -> Path:
    out = tmp_path / "gpu.imported.yaml"
    res = run("profile", "import", str(table), "--type", "gpu", "--model", "llama-tiny", "--base", "H800",
              "--out", str(out), *extra)
    assert res.exit_code == 0, res.output
    return out


def cluster() -> Cluster:
    return Cluster("two", {"gpu": DeviceType(80, 989, 3350, 400)}, (Node("n0", "gpu", 4), Node("n1", "gpu", 4)),
                   inter_node_bandwidth_gbs=25)


def test_import_reproduces_every_table_point(tmp_path: Path):
    rows = measured_rows()
    write_csv(tmp_path / "t.csv", rows)
    prof = load_profile(import_(tmp_path, tmp_path / "t.csv", "--includes-tp-comm"))
    assert prof.provenance == "imported" and prof.device_type == "gpu" and prof.iteration_s == 0.003
    assert prof.memory_gib == load_profile(REPO / "profiles" / "H800.yaml").memory_gib   # the base's figures
    for r in rows:
        if r["kind"] != "compute" or "layer" in r:
            continue
        cm = CostModel(TINY, cluster(), {"gpu": prof}, micro_batch=r["micro_batch"], seq_len=r["seq_len"])
        fit = cm.components("gpu", r["tp"])[r["component"]]
        assert eval_fit(fit.forward_s, r["micro_batch"], r["seq_len"]) == r["forward_s"]
        assert eval_fit(fit.backward_s, r["micro_batch"], r["seq_len"]) == r["backward_s"]
        if r["tp"] == 2:
            assert cm.stage("gpu", 2, 1, False, False).tp_comm_s == 0.0
    cm = CostModel(TINY, cluster(), {"gpu": prof}, micro_batch=1, seq_len=64)
    for r in rows:
        if r["kind"] == "link":   # same type both ends: a transfer takes the slower of send and recv
            slower = min(x["bandwidth_gbs"] for x in rows if x["kind"] == "link" and x["bytes"] == r["bytes"])
            assert cm.transfer_time(0, 4, r["bytes"]) == pytest.approx(r["bytes"] / (slower * 1e9), rel=1e-12)
        if r["kind"] == "allreduce":
            assert cm.allreduce_time([0, 4], r["bytes"]) == pytest.approx(r["bytes"] / (r["bandwidth_gbs"] * 1e9),
                                                                           rel=1e-12)


def test_round_trip_export_import_export(tmp_path: Path):
    write_csv(tmp_path / "t.csv", measured_rows())
    first = import_(tmp_path, tmp_path / "t.csv")
    res = run("profile", "export", str(first))
    assert res.exit_code == 0, res.output
    (tmp_path / "e1.csv").write_text(res.output)
    second = tmp_path / "again.yaml"
    assert run("profile", "import", str(tmp_path / "e1.csv"), "--type", "gpu", "--model", "llama-tiny", "--base",
               "H800", "--out", str(second)).exit_code == 0
    assert run("profile", "export", str(second)).output == res.output
    # JSON the same way, and the CSV and JSON tables hold the same rows.
    js = run("profile", "export", str(second), "--format", "json").output
    (tmp_path / "e1.json").write_text(js)
    assert run("profile", "import", str(tmp_path / "e1.json"), "--type", "gpu", "--model", "llama-tiny", "--base",
               "H800", "--out", str(tmp_path / "j.yaml")).exit_code == 0
    assert run("profile", "export", str(tmp_path / "j.yaml")).output == res.output
    assert json.loads(js) == table_rows(load_profile(first))


def test_fits_export_at_their_measured_points(tmp_path: Path):
    from tests.unit.profiling.test_profile_format import measured

    prof = measured()
    rows = table_rows(prof)
    (tmp_path / "m.csv").write_text(format_rows(rows, "csv"))
    mm = prof.models["llama-tiny"]
    assert len([r for r in rows if r["kind"] == "compute"]) == len(COMPONENTS) * len(mm.seq_lens)
    back = load_profile(import_(tmp_path, tmp_path / "m.csv"))
    cm = CostModel(TINY, cluster(), {"gpu": dataclasses.replace(back, device_type="gpu")}, micro_batch=1,
                   seq_len=mm.seq_lens[0])
    want = eval_fit(mm.tp[1]["mlp"].forward_s, 1, mm.seq_lens[0])
    assert eval_fit(cm.components("gpu", 1)["mlp"].forward_s, 1, mm.seq_lens[0]) == want


@pytest.mark.parametrize("edit, where, message", [
    (lambda r: r[3].update(forward_s="fast"), 5, "forward_s: expected a number, got 'fast'"),
    (lambda r: r[0].update(tp=0), 2, "tp: must be at least 1, got 0"),
    (lambda r: r[1].update(component="ffn"), 3,
     "component: expected one of embedding, attention, mlp, norm, head, layer, got 'ffn'"),
    (lambda r: r[2].update(bytes=4), 4, "bytes: not used on a compute row"),
    (lambda r: r[4].pop("backward_s"), 6,
     "backward_s: missing (a compute row needs component, tp, micro_batch, seq_len, forward_s, backward_s)"),
    (lambda r: r[1].update(optimizer_s=9.0), 3,
     "optimizer_s: 9.0 differs from row 2 (0.0001): one step per component and TP degree"),
])
def test_bad_row_is_one_line_naming_file_row_and_field(tmp_path: Path, edit, where: int, message: str):
    # The first CSV line is the header: rows[i] is line i + 2.
    rows = [r for r in measured_rows() if r["kind"] == "compute" and r["component"] == "embedding" and r["tp"] == 1]
    edit(rows)
    table = tmp_path / "bad.csv"
    write_csv(table, rows)
    out = tmp_path / "never.yaml"
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "profile", "import", str(table), "--type", "gpu",
                           "--model", "llama-tiny", "--base", "H800", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {table}:{where}: {message}"]
    assert not out.exists()


@pytest.mark.parametrize("text, says", [
    # A JSON integer of 400 digits: OverflowError in math.isfinite, a traceback.
    ('[{"kind": "compute", "component": "attention", "tp": 1, "micro_batch": 1, "seq_len": ' + "9" * 400 +
     ', "forward_s": 0.1, "backward_s": 0.2}]', ":1: seq_len: 9999999999999999999999999999999999999... is out of "
                                              "range (at most 9,007,199,254,740,992 in size)"),
    # 1e300 seconds were imported as measured (the spec files refuse figures beyond 1e30).
    ('[{"kind": "iteration", "seconds": 1e300}]', ":1: seconds: 1e+300 is out of range (at most 1e+30 in size)"),
    ("[]", ": no rows: the table measures nothing to import"),   # wrote the base profile back as 'imported'
])
def test_hostile_json_cells(tmp_path: Path, text: str, says: str):
    table = tmp_path / "t.json"
    table.write_text(text)
    out = tmp_path / "x.yaml"
    res = CliRunner().invoke(cli, ["profile", "import", str(table), "--type", "gpu", "--model", "llama-tiny",
                                   "--base", "H800", "--out", str(out)])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert res.output.strip().splitlines() == [f"error: {table}{says}"]
    assert not out.exists()


@pytest.mark.parametrize("text, says", [
    (",".join(COLUMNS) + "\n", ": no rows: the table measures nothing to import"),
    ("kind,seconds,kind\niteration,0.1,compute\n", ":1: kind: column given twice"),   # the last cell won, silently
    ("kind,seconds\niteration,1e300\n", ":2: seconds: '1e300' is out of range (at most 1e+30 in size)"),
])
def test_hostile_csv_tables(tmp_path: Path, text: str, says: str):
    table = tmp_path / "t.csv"
    table.write_text(text)
    out = tmp_path / "x.yaml"
    res = CliRunner().invoke(cli, ["profile", "import", str(table), "--type", "gpu", "--model", "llama-tiny",
                                   "--base", "H800", "--out", str(out)])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert res.output.strip().splitlines() == [f"error: {table}{says}"]
    assert not out.exists()


def test_incomplete_grid_names_what_is_missing(tmp_path: Path):
    rows = [r for r in measured_rows() if r["kind"] == "compute" and "layer" not in r]
    rows = [r for r in rows if not (r["component"] == "mlp" and r["tp"] == 2 and r["micro_batch"] == 4
                                    and r["seq_len"] == 256)]
    table = tmp_path / "t.json"
    table.write_text(json.dumps(rows))
    res = CliRunner().invoke(cli, ["profile", "import", str(table), "--type", "gpu", "--model", "llama-tiny",
                                   "--base", "H800", "--out", str(tmp_path / "x.yaml")])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        f"error: {table}: mlp at tp 2: missing micro_batch 4 x seq_len 256 (a table needs every combination of "
        "its micro-batch sizes and sequence lengths)"]


def test_show_any_profile(tmp_path: Path):
    write_csv(tmp_path / "t.csv", measured_rows())
    imported = import_(tmp_path, tmp_path / "t.csv")
    from tests.unit.profiling.test_profile_format import measured

    save_profile(measured(), tmp_path / "m.yaml")
    for ref in ("H800", str(imported), str(tmp_path / "m.yaml")):
        text = run("profile", "show", ref)
        assert text.exit_code == 0, text.output
        data = json.loads(run("profile", "show", ref, "--format", "json").output)
        assert data["profile"]["device_type"] in text.output
    shown = run("profile", "show", str(imported)).output
    assert "table" in shown and "inter send" in shown and "inter all-reduce x2" in shown
    measured_shown = run("profile", "show", str(tmp_path / "m.yaml")).output
    assert "p2p: 1.000 ms + bytes / 1.50 GB/s" in measured_shown
    assert run("profile", "show", "no-such-profile").exit_code == 2


def test_import_and_show_load_no_torch(tmp_path: Path):
    write_csv(tmp_path / "t.csv", measured_rows())
    probe = ("import sys\nfrom hetu_cli.main import cli\n"
             "cut = sys.argv.index('--next')\n"
             "for args in (sys.argv[1:cut], sys.argv[cut + 1:]):\n"
             "    try:\n        cli.main(args, prog_name='hspmd', standalone_mode=False)\n"
             "    except SystemExit as e:\n        assert not e.code, e.code\n"
             "print('torch' in sys.modules)\n")
    out = tmp_path / "p.yaml"
    proc = subprocess.run([sys.executable, "-c", probe, "profile", "import", str(tmp_path / "t.csv"), "--type", "gpu",
                           "--model", "llama-tiny", "--base", "H800", "--out", str(out), "--next", "profile", "show",
                           str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"
