"""The bounded loader: each hostile shape is one clear SpecError line naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.torchfree.errors import MAX_REPORTED, Problem, SpecError
from runtime.torchfree.spec import load_cluster, load_model, load_plan, load_plan_context
from runtime.torchfree.spec.io import ReadLimits, check_version, load_file, read_json, read_yaml
from runtime.torchfree.spec.model import ModelSpec

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
PLAN = CONFIGS / "plans" / "cpu-hetero4-tiny.yaml"


def one_line(fn, path: Path, *args, **kw) -> str:
    with pytest.raises(SpecError) as err:
        fn(path, *args, **kw)
    lines = err.value.lines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{path}: "), lines
    return lines[0]


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return p


@pytest.mark.parametrize("deep", [100, 20_000])
def test_deep_nesting_is_one_error_not_a_recursion_error(tmp_path, deep):
    p = write(tmp_path, "deep.yaml", "a: " + "[" * deep + "]" * deep + "\n")
    assert "nested more than 64 levels deep" in one_line(read_yaml, p)
    q = write(tmp_path, "deep.json", '{"a": ' + "[" * deep + "]" * deep + "}")
    assert "nested more than 64 levels deep" in one_line(read_json, q)


def test_depth_within_the_bound_reads(tmp_path):
    p = write(tmp_path, "ok.yaml", "a: " + "[" * 60 + "1" + "]" * 60 + "\n")
    data = read_yaml(p)["a"]
    for _ in range(60):
        data = data[0]
    assert data == 1


BOMB = "\n".join([
    'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]',
    "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]",
    "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]",
    "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]",
    "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]",
]) + "\n"


def test_alias_bomb_is_refused(tmp_path):
    p = write(tmp_path, "bomb.yaml", BOMB)
    line = one_line(read_yaml, p)
    assert "line 4, column 8" in line and "YAML aliases nested 3 deep (alias *c" in line


def test_alias_expansion_bound(tmp_path):
    # Two levels of aliases are allowed, but their expansion is still bounded.
    p = write(tmp_path, "wide.yaml", BOMB.split("\nc:")[0] + "\n")
    assert read_yaml(p)["b"][0] == ["x"] * 9
    line = one_line(read_yaml, p, ReadLimits(max_nodes=50))
    assert "expand to more than 50 nodes" in line


def test_alias_count_bound(tmp_path):
    p = write(tmp_path, "many.yaml", "a: &a 1\nb: [" + ", ".join(["*a"] * 20) + "]\n")
    assert read_yaml(p)["b"] == [1] * 20
    assert "more than 10 YAML aliases" in one_line(read_yaml, p, ReadLimits(max_aliases=10))


def test_recursive_alias_is_refused(tmp_path):
    p = write(tmp_path, "rec.yaml", "x: &x [1, *x]\n")
    assert "alias *x is used inside its own anchor" in one_line(read_yaml, p)


def test_nested_aliases_in_a_plan_are_one_error_not_a_screenful(tmp_path):
    p = write(tmp_path, "plan.yaml", "version: 1\n" + BOMB)
    assert "YAML aliases nested 3 deep" in one_line(load_plan, p)


def test_merge_keys_still_work(tmp_path):
    p = write(tmp_path, "merge.yaml", "base: &b {x: 1, y: 2}\nc: {<<: *b, y: 3}\n")
    assert read_yaml(p)["c"] == {"x": 1, "y": 3}


def test_duplicate_keys(tmp_path):
    p = write(tmp_path, "dup.yaml", "a: 1\nb: {c: 1, c: 2}\n")
    assert "line 2, column 11: refused YAML: duplicate key 'c' (first at line 2)" in one_line(read_yaml, p)
    q = write(tmp_path, "dup.json", '{"a": 1, "a": 2}')
    assert "duplicate key 'a'" in one_line(read_json, q)


def test_strict_decoding(tmp_path):
    p = write(tmp_path, "latin1.yaml", "name: caf\xe9\n".encode("latin-1"))
    assert "line 1: not UTF-8 text (byte 0xe9 at offset 9)" in one_line(read_yaml, p)
    q = write(tmp_path, "nul.yaml", b"a: 1\nb: \x00\n")
    assert "line 2: malformed YAML: character #x0000 is not allowed" in one_line(read_yaml, q)
    r = write(tmp_path, "nan.json", '{"a": NaN}')
    assert "NaN is not a JSON number" in one_line(read_json, r)
    s = write(tmp_path, "bom.yaml", "\ufeffa: 1\n")
    assert read_yaml(s) == {"a": 1}


def test_size_bound(tmp_path):
    p = write(tmp_path, "big.yaml", "a: " + "1" * 200 + "\n")
    assert "larger than 100 bytes" in one_line(read_yaml, p, ReadLimits(max_bytes=100))


def test_huge_integer_is_a_user_error(tmp_path):
    p = write(tmp_path, "int.yaml", "a: " + "9" * 10_000 + "\n")
    assert "malformed YAML" in one_line(read_yaml, p)


def test_unsafe_tags_are_refused(tmp_path):
    p = write(tmp_path, "tag.yaml", "a: !!python/object/apply:os.system ['true']\n")
    assert "malformed YAML" in one_line(read_yaml, p)


def test_not_found_directory_empty(tmp_path):
    assert "file not found" in one_line(read_yaml, tmp_path / "nope.yaml")
    assert "is a directory" in one_line(read_yaml, tmp_path)
    p = write(tmp_path, "empty.yaml", "")
    assert "is empty" in one_line(lambda path: load_file(ModelSpec, path), p)


def test_version_is_checked_first(tmp_path):
    text = PLAN.read_text().replace("version: 1", "version: 999") + "bogus: 1\ntraining: 3\n"
    p = write(tmp_path, "future.yaml", text.replace("training:", "trainin:", 1))
    assert one_line(load_plan_context, p) == f"{p}: version: version 999 is newer than this hspmd reads (1)"
    for value, expect in (("0", "version 0 is not one this hspmd reads (1)"),
                          ("'1'", "expected an integer, got '1' (str)"),
                          ("true", "expected an integer, got True (bool)")):
        q = write(tmp_path, "v.yaml", PLAN.read_text().replace("version: 1", f"version: {value}"))
        assert one_line(load_plan, q).endswith(f"version: {expect}")
    r = write(tmp_path, "nov.yaml", PLAN.read_text().replace("version: 1\n", ""))
    assert one_line(load_plan, r).endswith("version: missing required field (this hspmd reads version 1)")


def test_check_version_ignores_non_mappings():
    check_version([1, 2], 1, "f")  # the schema reports "expected a mapping" instead


def test_error_list_is_capped():
    problems = [Problem("f.yaml", f"k{i}", "unknown key") for i in range(MAX_REPORTED + 12)]
    lines = SpecError(problems).lines()
    assert len(lines) == MAX_REPORTED + 1
    assert lines[-1] == "f.yaml: ... and 12 more"
    assert len(SpecError(problems).problems) == MAX_REPORTED + 12


def test_many_unknown_keys_are_capped(tmp_path):
    p = write(tmp_path, "keys.yaml", "version: 1\n" + "".join(f"k{i}: 1\n" for i in range(40)))
    with pytest.raises(SpecError) as err:
        load_plan(p)
    lines = err.value.lines()
    assert len(lines) == MAX_REPORTED + 1 and lines[-1].startswith(f"{p}: ... and ")
    assert all(line.startswith(f"{p}: ") for line in lines)


def test_sizes_that_would_make_every_verb_enumerate_forever_are_refused(tmp_path):
    cluster = (CONFIGS / "clusters" / "cpu-hetero4.yaml").read_text().replace("count: 2", "count: 999999999999")
    p = write(tmp_path, "c.yaml", cluster)
    with pytest.raises(SpecError) as err:
        load_cluster(str(p))
    assert err.value.lines() == [f"{p}: nodes: 1,999,999,999,998 devices in all: hspmd plans for at most 65,536"]
    model = (CONFIGS / "models" / "llama-tiny.yaml").read_text().replace("num_layers: 6", "num_layers: 99999999999")
    q = write(tmp_path, "m.yaml", model)
    with pytest.raises(SpecError) as err:
        load_model(str(q))
    assert err.value.lines() == [f"{q}: num_layers: must be at most 1024, got 99999999999"]


def test_an_absurd_emulated_slowdown_is_refused(tmp_path):
    # 1e30 made the planner's ILP numerically degenerate (a PuLP IndexError instead of an answer).
    text = (CONFIGS / "clusters" / "cpu-hetero4.yaml").read_text().replace("slowdown: 3.0", "slowdown: 1.0e+30")
    p = write(tmp_path, "c.yaml", text)
    with pytest.raises(SpecError) as err:
        load_cluster(str(p))
    assert err.value.lines() == [f"{p}: device_types.cpu-slow.emulate.slowdown: must be at most 1000, got 1e+30"]


def test_a_named_pipe_nothing_writes_to_is_refused_not_waited_on(tmp_path):
    """open() of a FIFO blocks until a writer comes: hspmd validate FIFO hung forever."""
    import os
    import time

    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(SpecError) as err:
        read_yaml(fifo, ReadLimits(pipe_wait_s=0.2))
    assert time.monotonic() - t0 < 5
    assert err.value.lines() == [f"{fifo}: a named pipe that nothing wrote to within 0.2 s (give a file)"]


def test_a_pipe_with_a_writer_reads(tmp_path):
    """Process substitution (<(...)) and a written FIFO still read."""
    import os
    import threading

    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "w") as f:
            f.write("a: 1\nb: [2, 3]\n")

    writer = threading.Thread(target=write)
    writer.start()
    assert read_yaml(fifo) == {"a": 1, "b": [2, 3]}
    writer.join(5)
    r, w = os.pipe()
    os.write(w, b"x: 5\n")
    os.close(w)
    try:
        assert read_yaml(f"/dev/fd/{r}") == {"x": 5}
    finally:
        os.close(r)
