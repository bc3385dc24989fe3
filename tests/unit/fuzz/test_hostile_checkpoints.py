"""Hostile checkpoint directories through every reader: ``checkpoint_info`` (what ``hspmd train --load``
checks before any worker starts), ``load_checkpoint`` (what each worker then reads), ``hspmd export`` and
``hspmd train --load`` themselves; and hostile ``--save`` / ``--out`` targets and a save that fails
part-way through.

Each case starts from a real checkpoint (written by ``write_checkpoint`` for llama-tiny: unsharded, and
sharded into many small files) and breaks one thing. Whatever is broken: exit code 2, one line per problem
that names the file (and the field or tensor), no traceback, nothing written; and a save that fails leaves
the previous checkpoint loadable as it was.

Under root, the unreadable-file and read-only-parent cases are skipped (root reads and writes through any
mode bits, so they would assert nothing). A crash during the renames that end a save (as opposed to a
failure while writing) is refused by the save id: tests/unit/train/test_hf_checkpoint.py's torn save.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save

from hetu_cli.main import cli
from runtime.checkpoint import (
    CHECKPOINT_FILE,
    FORMAT,
    OPTIMIZER_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    expected_tensors,
    load_checkpoint,
    read_checkpoint_info,
    write_checkpoint,
)
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import load_plan_context

REPO = Path(__file__).resolve().parents[3]
PLAN = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"
STEP = 3


@pytest.fixture(scope="module")
def ctx():
    return load_plan_context(PLAN)


@pytest.fixture(scope="module")
def state(ctx) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in expected_tensors(ctx.model).items()}


def save_to(directory: Path, ctx, state: dict[str, torch.Tensor], step: int = STEP, **kw) -> Path:
    weights = {p.name: state[p.name] for p in llama_parameters(ctx.model)}
    moments = {k: v for k, v in state.items() if k not in weights}
    write_checkpoint(directory, ctx.model, weights, moments=moments, step=step, saved_by="test", **kw)
    return directory


@pytest.fixture(scope="module")
def originals(tmp_path_factory, ctx, state) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("originals")
    legacy = root / "legacy"
    legacy.mkdir()
    (legacy / CHECKPOINT_FILE).write_bytes(save(state, metadata={"format": FORMAT, "step": str(STEP),
                                                                 "model": "llama-tiny"}))
    return {"single": save_to(root / "single", ctx, state),
            "sharded": save_to(root / "sharded", ctx, state, shard_bytes=20_000), "legacy": legacy}


@dataclass
class Shard:
    region: tuple[slice, ...]


class WholeProgram:
    """The stand-in DeviceProgram of a device holding ``regions`` of parameters (default: every parameter
    whole; no ZeRO-1)."""

    def __init__(self, ctx, regions: dict[str, tuple[slice, ...]] | None = None) -> None:
        self.regions = regions if regions is not None else {
            p.name: tuple(slice(0, d) for d in p.shape) for p in llama_parameters(ctx.model)}
        self.loaded: dict[str, torch.Tensor] = {}

    def param_annotations(self) -> dict[str, Shard]:
        return {n: Shard(r) for n, r in self.regions.items()}

    def moment_pieces(self) -> dict:
        return {}

    def load_local_state(self, state: dict[str, torch.Tensor]) -> None:
        self.loaded = state


# ---------------------------------------------------------------------------------------------------
# Mutations: each takes a copy of an original checkpoint directory and breaks one thing.

def rewrite(path: Path, tensors: Callable[[dict], dict] | None = None,
            metadata: Callable[[dict], dict | None] | None = None) -> None:
    """Write ``path`` again with its tensors and/or metadata changed (a well-formed safetensors file)."""
    with safe_open(path, framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        m = f.metadata()
    path.write_bytes(save(tensors(t) if tensors else t, metadata=metadata(m) if metadata else m))


def header_length(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def truncate(at: int | Callable[[Path], int]) -> Callable[[Path], None]:
    def cut(d: Path) -> None:
        p = d / WEIGHTS_FILE
        data = p.read_bytes()
        p.write_bytes(data[:at(p) if callable(at) else at])
    return cut


def set_step(value: str | None) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        rewrite(d / OPTIMIZER_FILE, metadata=lambda m: {k: v for k, v in m.items() if k != "step"}
                | ({} if value is None else {"step": value}))
    return mutate


def replace_tensor(name: str, value: torch.Tensor, file: str = WEIGHTS_FILE) -> Callable[[Path], None]:
    return lambda d: rewrite(d / file, tensors=lambda t: {**t, name: value})


def drop_tensor(name: str, file: str = WEIGHTS_FILE) -> Callable[[Path], None]:
    return lambda d: rewrite(d / file, tensors=lambda t: {k: v for k, v in t.items() if k != name})


def edit_json(file: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        data = json.loads((d / file).read_text())
        edit(data)
        (d / file).write_text(json.dumps(data))
    return mutate


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*-of-*.safetensors"))


def break_header_json(d: Path) -> None:
    p = d / WEIGHTS_FILE
    data = p.read_bytes()
    n = header_length(p)
    p.write_bytes(data[:8] + b"{" * n + data[8 + n:])


def replace_dir(d: Path, make: Callable[[Path], None]) -> None:
    """Put what ``make`` makes in the place of file or directory ``d``."""
    if d.is_dir():
        shutil.rmtree(d)
    else:
        d.unlink()
    make(d)


# (name, original, mutation, the line expected first, with {d} for the checkpoint directory)
REFUSED: list[tuple[str, str, Callable[[Path], None], str]] = [
    ("missing directory", "single", lambda d: shutil.rmtree(d), "{d}: --load: no such directory"),
    # Regression: a file was called "no such directory".
    ("a file instead of a directory", "single", lambda d: replace_dir(d, lambda p: p.write_text("x")),
     "{d}: --load: not a directory"),
    ("empty directory", "single", lambda d: replace_dir(d, Path.mkdir),
     "{d}: --load: no checkpoint in this directory (model.safetensors, model.safetensors.index.json or "
     "checkpoint.safetensors not found)"),
    ("empty weights file", "single", truncate(0),
     "{d}/model.safetensors: not a readable safetensors file: Error while deserializing header: header too small"),
    ("cut inside the header length", "single", truncate(5),
     "{d}/model.safetensors: not a readable safetensors file: Error while deserializing header: header too small"),
    ("cut right after the header length", "single", truncate(8),
     "{d}/model.safetensors: not a readable safetensors file: Error while deserializing header: invalid header "
     "length"),
    ("cut inside the JSON header", "single", truncate(lambda p: 8 + header_length(p) // 2),
     "{d}/model.safetensors: not a readable safetensors file: Error while deserializing header: invalid header "
     "length"),
    ("cut inside the tensor data", "single", truncate(lambda p: 8 + header_length(p) + 100),
     "{d}/model.safetensors: not a readable safetensors file: Error while deserializing header: incomplete "
     "metadata, file not fully covered"),
    ("last byte cut", "single", truncate(-1),
     "{d}/model.safetensors: not a readable safetensors file: Error while deserializing header: incomplete "
     "metadata, file not fully covered"),
    ("invalid JSON header", "single", break_header_json,
     "{d}/model.safetensors: not a readable safetensors file: Error while deserializing header: invalid JSON in "
     "header: key must be a string at line 1 column 2"),
    ("huge declared header length", "single",
     lambda d: (d / WEIGHTS_FILE).write_bytes(struct.pack("<Q", 2**62) + (d / WEIGHTS_FILE).read_bytes()[8:]),
     "{d}/model.safetensors: not a readable safetensors file: Error while deserializing header: header too large"),
    ("header length past the end", "single",
     lambda d: (d / WEIGHTS_FILE).write_bytes(struct.pack("<Q", 50_000_000) + (d / WEIGHTS_FILE).read_bytes()[8:]),
     "{d}/model.safetensors: not a readable safetensors file: Error while deserializing header: invalid header "
     "length"),
    ("wrong shape", "single", replace_tensor("model.norm.weight", torch.zeros(3)),
     "{d}/model.safetensors: model.norm.weight: has shape [3], model llama-tiny needs [64]"),
    # Regressions: integer and boolean tensors passed the checks and were converted into fp32 weights.
    ("integer weights", "single", replace_tensor("model.norm.weight", torch.ones(64, dtype=torch.int64)),
     "{d}/model.safetensors: model.norm.weight: has dtype I64, expected a floating-point dtype (F32, BF16, F16, "
     "...)"),
    ("boolean weights", "single", replace_tensor("model.norm.weight", torch.ones(64, dtype=torch.bool)),
     "{d}/model.safetensors: model.norm.weight: has dtype BOOL, expected a floating-point dtype"),
    ("byte moments", "single",
     replace_tensor("model.norm.weight.exp_avg", torch.ones(64, dtype=torch.uint8), OPTIMIZER_FILE),
     "{d}/optimizer.safetensors: model.norm.weight.exp_avg: has dtype U8, expected a floating-point dtype"),
    ("missing tensor", "single", drop_tensor("model.norm.weight"),
     "{d}/model.safetensors: model.norm.weight: missing (model llama-tiny needs it)"),
    ("missing moment", "single", drop_tensor("model.norm.weight.exp_avg", OPTIMIZER_FILE),
     "{d}/optimizer.safetensors: model.norm.weight.exp_avg: missing (model llama-tiny needs it)"),
    ("unknown tensor", "single", replace_tensor("foo.bar", torch.zeros(2)),
     "{d}/model.safetensors: foo.bar: unexpected tensor (model llama-tiny has no such parameter)"),
    # Regression: unknown tensors in the optimizer file were ignored (the weights file refused them).
    ("unknown moment", "single", replace_tensor("model.layers.9.mlp.up_proj.weight.exp_avg", torch.zeros(2),
                                                OPTIMIZER_FILE),
     "{d}/optimizer.safetensors: model.layers.9.mlp.up_proj.weight.exp_avg: unexpected tensor (model llama-tiny "
     "has no such state)"),
    ("step missing", "single", set_step(None),
     "{d}/optimizer.safetensors: metadata.step: expected a step count, got None"),
    ("step a string", "single", set_step("x"),
     "{d}/optimizer.safetensors: metadata.step: expected a step count, got 'x'"),
    ("step negative", "single", set_step("-1"),
     "{d}/optimizer.safetensors: metadata.step: expected a step count, got '-1'"),
    ("step 1e308", "single", set_step("1e308"),
     "{d}/optimizer.safetensors: metadata.step: expected a step count, got '1e308'"),
    ("step nan", "single", set_step("nan"),
     "{d}/optimizer.safetensors: metadata.step: expected a step count, got 'nan'"),
    # Regressions: str.isdigit took '²' (then int() raised ValueError: a traceback); 400 digits passed the
    # checks and load_checkpoint raised OverflowError (float(step)); 5000 digits raised ValueError in int().
    ("step a superscript digit", "single", set_step("\u00b2"),
     "{d}/optimizer.safetensors: metadata.step: expected a step count, got '\u00b2'"),
    ("step 400 digits", "single", set_step("9" * 400),
     "{d}/optimizer.safetensors: metadata.step: expected a step count, got '99999999999999999999999999999... "
     "(402 characters)"),
    ("step 5000 digits", "single", set_step("9" * 5000),
     "{d}/optimizer.safetensors: metadata.step: expected a step count, got '99999999999999999999999999999... "
     "(5002 characters)"),
    ("step past 2**53", "single", set_step(str(2**53 + 1)),
     "{d}/optimizer.safetensors: metadata.step: expected a step count, got '9007199254740993'"),
    ("format missing", "single", lambda d: rewrite(d / OPTIMIZER_FILE, metadata=lambda m: {
        k: v for k, v in m.items() if k != "format"}),
     "{d}/optimizer.safetensors: metadata.format: expected 'hspmd-optimizer/1', got None"),
    ("metadata value not a string", "single", lambda d: _int_metadata(d / OPTIMIZER_FILE),
     "{d}/optimizer.safetensors: not a readable safetensors file: Error while deserializing header: invalid JSON "
     "in header: invalid type: integer `5`, expected a string at line 1 column"),
    ("config.json of another model", "single",
     edit_json("config.json", lambda c: c.update(intermediate_size=96)),
     "{d}/config.json: intermediate_size: 96 differs from the plan's model llama-tiny (ffn_hidden_size: 128)"),
    ("config.json of another family", "single", edit_json("config.json", lambda c: c.update(model_type="gpt2")),
     "{d}/config.json: n_layer: missing required field"),
    ("config.json not JSON", "single", lambda d: (d / "config.json").write_text("{nope"),
     "{d}/config.json: line 1, column 2: malformed JSON: Expecting property name enclosed in double quotes"),
    ("optimizer of another save", "single",
     lambda d: rewrite(d / OPTIMIZER_FILE, metadata=lambda m: {**m, "hspmd_save": "other"}),
     "{d}: holds files of different saves (model.safetensors: "),
    ("symlink loop as the directory", "single", lambda d: replace_dir(d, lambda p: os.symlink(p, p)),
     "{d}: --load: no such directory"),
    # Regressions: an optimizer file that is a directory or a symlink loop was read as absent: the weights
    # loaded with zero moments at step 0, silently. A weights file or config.json in such a state was
    # reported as "not found" (or, config.json, ignored).
    ("optimizer file a directory", "single", lambda d: replace_dir(d / OPTIMIZER_FILE, Path.mkdir),
     "{d}/optimizer.safetensors: is a directory, expected a file"),
    ("optimizer file a symlink loop", "single",
     lambda d: replace_dir(d / OPTIMIZER_FILE, lambda p: os.symlink(p.name, p)),
     "{d}/optimizer.safetensors: is a broken or looping symbolic link, expected a file"),
    ("weights file a directory", "single", lambda d: replace_dir(d / WEIGHTS_FILE, Path.mkdir),
     "{d}/model.safetensors: is a directory, expected a file"),
    ("weights file a symlink loop", "single",
     lambda d: replace_dir(d / WEIGHTS_FILE, lambda p: os.symlink(p.name, p)),
     "{d}/model.safetensors: is a broken or looping symbolic link, expected a file"),
    ("config.json a directory", "single", lambda d: replace_dir(d / "config.json", Path.mkdir),
     "{d}/config.json: is a directory, expected a file"),
    ("index a dangling symlink", "sharded", lambda d: replace_dir(d / WEIGHTS_INDEX, lambda p: os.symlink("gone", p)),
     "{d}/model.safetensors.index.json: is a broken or looping symbolic link, expected a file"),
    # The older single-file format: the same checks (a superscript step raised ValueError here too).
    ("legacy step a superscript digit", "legacy",
     lambda d: rewrite(d / CHECKPOINT_FILE, metadata=lambda m: {**m, "step": "\u00b2"}),
     "{d}/checkpoint.safetensors: metadata.step: expected a step count, got '\u00b2'"),
    ("legacy cut short", "legacy",
     lambda d: (d / CHECKPOINT_FILE).write_bytes((d / CHECKPOINT_FILE).read_bytes()[:-7]),
     "{d}/checkpoint.safetensors: not a readable safetensors file: Error while deserializing header: incomplete "
     "metadata, file not fully covered"),
    ("legacy integer moment", "legacy",
     replace_tensor("model.norm.weight.exp_avg_sq", torch.ones(64, dtype=torch.int32), CHECKPOINT_FILE),
     "{d}/checkpoint.safetensors: model.norm.weight.exp_avg_sq: has dtype I32, expected a floating-point dtype"),
    ("shard missing", "sharded", lambda d: shards(d)[1].unlink(),
     "{d}/model.safetensors.index.json: weight_map: names 'model-00002-of-00039.safetensors', not a file in {d}"),
    ("shard duplicated over another", "sharded", lambda d: shards(d)[1].write_bytes(shards(d)[0].read_bytes()),
     "{d}/model-00002-of-00039.safetensors: model.embed_tokens.weight: also in model-00001-of-00039.safetensors"),
    # Regression: a tensor held by two shards (with different values) loaded from the later one, silently.
    ("tensor in two shards", "sharded", lambda d: _copy_tensor(shards(d)[0], shards(d)[1]),
     "{d}/model-00002-of-00039.safetensors: model.embed_tokens.weight: also in model-00001-of-00039.safetensors; a "
     "tensor belongs to one file"),
    ("index names an absent shard", "sharded", edit_json(WEIGHTS_INDEX, lambda i: i["weight_map"].update(
        {"model.norm.weight": "model-00099-of-00099.safetensors"})),
     "{d}/model.safetensors.index.json: weight_map: names 'model-00099-of-00099.safetensors', not a file in {d}"),
    ("index names a path outside", "sharded", edit_json(WEIGHTS_INDEX, lambda i: i["weight_map"].update(
        {"model.norm.weight": "../model.safetensors"})),
     "{d}/model.safetensors.index.json: weight_map: names '../model.safetensors', not a file in {d}"),
    ("index without weight_map", "sharded", lambda d: (d / WEIGHTS_INDEX).write_text("{}"),
     "{d}/model.safetensors.index.json: weight_map: expected an object of tensor name -> file name"),
    ("index not UTF-8", "sharded", lambda d: (d / WEIGHTS_INDEX).write_bytes(b'{"weight_map": {"a": "\xff"}}'),
     "{d}/model.safetensors.index.json: line 1: not UTF-8 text (byte 0xff at offset 22)"),
    # Regression: a list as the save id raised TypeError (unhashable), a traceback.
    ("index save id a list", "sharded", edit_json(WEIGHTS_INDEX, lambda i: i["metadata"].update(hspmd_save=[1])),
     "{d}/model.safetensors.index.json: metadata.hspmd_save: expected a save id (a string), got list"),
    ("index missing", "sharded", lambda d: (d / WEIGHTS_INDEX).unlink(),
     "{d}: --load: no checkpoint in this directory (model.safetensors, model.safetensors.index.json or "
     "checkpoint.safetensors not found)"),
]


def _int_metadata(path: Path) -> None:
    """A metadata value that is a JSON number: safetensors itself allows only strings there."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["step"] = 5
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _copy_tensor(src: Path, dst: Path) -> None:
    """``src``'s first tensor, changed, also into ``dst``."""
    with safe_open(src, framework="pt") as f:
        name = next(iter(f.keys()))
        value = f.get_tensor(name) + 1
    rewrite(dst, tensors=lambda t: {**t, name: value})


def broken(originals: dict[str, Path], tmp_path: Path, original: str, mutate: Callable[[Path], None]) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(originals[original], d)
    mutate(d)
    return d


def shown(line: str) -> str:
    """``line`` as the terminal gets it: an undecodable byte of a file name (a lone surrogate) escaped."""
    return line.encode("utf-8", "backslashreplace").decode("utf-8")


def assert_refused(d: Path, ctx, first: str, tmp_path: Path) -> None:
    """Every reader refuses ``d`` the same way: the checks, a worker's load, export, train."""
    with pytest.raises(HspmdError) as err:
        read_checkpoint_info(d, ctx)
    lines = err.value.lines()
    assert lines[0].startswith(first.format(d=d)), lines
    with pytest.raises(HspmdError):
        load_checkpoint(WholeProgram(ctx), d, ctx)
    runner = CliRunner()
    res = runner.invoke(cli, ["train", "--plan", str(PLAN), "--load", str(d), "--save", str(tmp_path / "save"),
                              "--metrics", str(tmp_path / "m.jsonl")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.stderr.strip().splitlines() == [shown(f"error: {line}") for line in lines]
    assert not (tmp_path / "save").exists() and not (tmp_path / "m.jsonl").exists()
    out = tmp_path / "export"
    res = runner.invoke(cli, ["export", "--checkpoint", str(d), "--out", str(out), "--model", "llama-tiny"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.stderr.strip().splitlines() == [shown(f"error: {line.replace(': --load: ', ': --checkpoint: ')}")
                                               for line in lines]
    assert not out.exists()


@pytest.mark.parametrize(("original", "mutate", "first"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_hostile_checkpoint_is_refused_by_every_reader(originals, ctx, tmp_path, original, mutate, first):
    assert_refused(broken(originals, tmp_path, original, mutate), ctx, first, tmp_path)


@pytest.mark.parametrize("original", ["single", "sharded", "legacy"])
def test_the_originals_load_whole(originals, ctx, state, original):
    """The baseline the mutations break: each original loads every tensor exactly, at its step."""
    program = WholeProgram(ctx)
    assert load_checkpoint(program, originals[original], ctx) == STEP
    assert float(program.loaded.pop("step")) == STEP
    assert set(program.loaded) == set(state)
    assert all(torch.equal(program.loaded[k], v) for k, v in state.items())


def test_export_names_its_own_option_and_what_is_missing(originals, tmp_path):
    """Regressions: export's refusals of a checkpoint said ``--load`` (an option export does not have), and
    a --save directory without config.json was "no checkpoint in this directory"."""
    d = broken(originals, tmp_path, "sharded", lambda d: (d / WEIGHTS_INDEX).unlink())
    runner = CliRunner()
    res = runner.invoke(cli, ["export", "--checkpoint", str(d), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
        f"error: {d}: --checkpoint: no checkpoint in this directory (model.safetensors, "
        "model.safetensors.index.json or checkpoint.safetensors not found)"]
    d = tmp_path / "no-config"
    shutil.copytree(originals["single"], d)
    (d / "config.json").unlink()
    res = runner.invoke(cli, ["export", "--checkpoint", str(d), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
        f"error: {d}: --checkpoint: no config.json to say which model its weights are; name it with --model"]
    assert not (tmp_path / "out").exists()
    res = runner.invoke(cli, ["export", "--checkpoint", str(d), "--out", str(tmp_path / "out"), "--model",
                              "llama-tiny"])
    assert res.exit_code == 0, res.output


def test_a_non_utf8_directory_name_is_refused_clearly(originals, ctx, tmp_path):
    """safetensors opens only UTF-8 paths: a checkpoint under a non-UTF-8 name cannot be read. Regression:
    ``--save`` took such a directory (and wrote a checkpoint that no --load could open)."""
    d = tmp_path / os.fsdecode(b"ck\xff")
    shutil.copytree(originals["single"], d)
    assert_refused(d, ctx, "{d}/model.safetensors: the path is not valid UTF-8, and safetensors opens only UTF-8 "
                           "paths; rename the directory", tmp_path)
    res = CliRunner().invoke(cli, ["train", "--plan", str(PLAN), "--save", str(d / "again")])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [shown(
        f"error: {d / 'again'}: --save: the path is not valid UTF-8, and safetensors opens only UTF-8 paths: the "
        "checkpoint could not be loaded")]


@pytest.mark.parametrize("target", ["under a file", "a symlink loop", "a file"])
def test_an_unusable_save_target_is_refused_before_anything_runs(tmp_path, target):
    """Regression: ``--save FILE/ck`` (and a symlink loop) passed the checks, so the run trained to its end
    and then died in the writer with a traceback (NotADirectoryError), exit 1; ``--out FILE/ck`` the same."""
    (tmp_path / "file").write_text("x")
    os.symlink("loop", tmp_path / "loop")
    path, message = {"under a file": (tmp_path / "file" / "ck", f"{tmp_path / 'file'} is not a directory"),
                     "a symlink loop": (tmp_path / "loop", "exists and is not a directory"),
                     "a file": (tmp_path / "file", "exists and is not a directory")}[target]
    runner = CliRunner()
    res = runner.invoke(cli, ["train", "--plan", str(PLAN), "--save", str(path), "--metrics", str(tmp_path / "m")])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [f"error: {path}: --save: {message}"]
    assert not (tmp_path / "m").exists()
    res = runner.invoke(cli, ["export", "--checkpoint", str(REPO / "configs"), "--out", str(path)])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [f"error: {path}: --out: {message}"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through mode bits: a read-only parent means nothing")
def test_a_read_only_parent_is_refused_before_anything_runs(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    res = CliRunner().invoke(cli, ["train", "--plan", str(PLAN), "--save", str(parent / "ck")])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
        f"error: {parent / 'ck'}: --save: {parent} is not writable"]


def test_a_documents_run_checks_load_and_save_before_starting_workers(originals, tmp_path):
    """Regression: a documents run (``--lengths``, JSONL ``--data``, ...) returned from the checks before
    reaching --load and --save: a bad checkpoint failed in every worker once they had started, and a bad
    --save target only after the whole run had trained."""
    (tmp_path / "file").write_text("x")
    runner = CliRunner()
    res = runner.invoke(cli, ["train", "--plan", str(PLAN), "--lengths", "fixed", "--load", str(tmp_path / "nope"),
                              "--metrics", str(tmp_path / "m")])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nope'}: --load: no such directory"]
    res = runner.invoke(cli, ["train", "--plan", str(PLAN), "--lengths", "fixed", "--save",
                              str(tmp_path / "file" / "ck"), "--metrics", str(tmp_path / "m")])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'file' / 'ck'}: --save: {tmp_path / 'file'} is not a directory"]
    assert not (tmp_path / "m").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads through mode bits: an unreadable file means nothing")
def test_an_unreadable_file_is_one_line(originals, ctx, tmp_path):
    d = broken(originals, tmp_path, "single", lambda d: (d / WEIGHTS_FILE).chmod(0))
    assert_refused(d, ctx, "{d}/model.safetensors: not a readable safetensors file", tmp_path)


@pytest.mark.parametrize("original", ["single", "sharded"])
@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_save_that_fails_part_way_leaves_the_previous_one_whole(originals, ctx, state, tmp_path, monkeypatch,
                                                                  original, fail_at):
    """Regression: each file was renamed into place as soon as it was written, so a save that failed at
    its second file (a full disk) left the new weights beside the old optimizer file: the directory was
    refused as torn, the previous checkpoint lost; and the error was an OSError traceback."""
    d = tmp_path / "ck"
    shutil.copytree(originals[original], d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    calls = []
    real = os.fsync

    def failing(fd: int) -> None:
        calls.append(fd)
        if len(calls) == fail_at:
            raise OSError(28, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    newer = {k: v + 1 for k, v in state.items()}
    with pytest.raises(HspmdError) as err:
        save_to(d, ctx, newer, step=STEP + 1, **({"shard_bytes": 20_000} if original == "sharded" else {}))
    assert err.value.lines() == [f"{d}: cannot write the checkpoint: No space left on device"]
    monkeypatch.setattr(os, "fsync", real)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # no file replaced, no temporary left
    program = WholeProgram(ctx)
    assert load_checkpoint(program, d, ctx) == STEP
    assert all(torch.equal(program.loaded[k], v) for k, v in state.items())
    # And into a new directory: nothing is left of it.
    calls.clear()
    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(HspmdError):
        save_to(tmp_path / "new" / "ck", ctx, newer)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(("content", "problem"), [
    (b"{nope", "line 1, column 2: malformed JSON: Expecting property name enclosed in double quotes"),
    (b"[1]", "expected a JSON object, got list"),
    (b'{"strategy": 3}', "strategy: expected a strategy name, got 3"),
])
def test_a_broken_dispatch_state_is_refused_before_starting_workers(originals, tmp_path, content, problem):
    """Regression: a documents run's ``dispatch.json`` beside the checkpoint was read with json.loads in
    every worker: '{nope' killed them with JSONDecodeError, a traceback and exit 1."""
    d = broken(originals, tmp_path, "single", lambda d: (d / "dispatch.json").write_bytes(content))
    res = CliRunner().invoke(cli, ["train", "--plan", str(PLAN), "--lengths", "fixed", "--load", str(d),
                                   "--metrics", str(tmp_path / "m")])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [f"error: {d / 'dispatch.json'}: {problem}"]
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("original", ["single", "sharded"])
def test_a_checkpoint_of_another_plan_loads_into_any_layout(originals, ctx, state, tmp_path, original):
    """The format promises plan-independence (runtime/checkpoint.py): a checkpoint saved by another plan and
    strategy (``saved_by`` names them; nothing else does) loads into this plan's layout. Four devices holding
    TP-4 column and row shards each read exactly their region."""
    d = broken(originals, tmp_path, original, lambda d: rewrite(
        d / OPTIMIZER_FILE, metadata=lambda m: {**m, "saved_by": "elsewhere/other.yaml (strategy gone)"}))
    assert read_checkpoint_info(d, ctx).saved_by == "elsewhere/other.yaml (strategy gone)"
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.4.mlp.down_proj.weight", "model.norm.weight"]
    whole = {n: tuple(state[n].shape) for n in names}
    for rank in range(4):
        regions = {}
        for n, shape in whole.items():
            dim = 1 if "down_proj" in n else 0  # row-parallel splits the input dimension
            size = shape[dim] // 4 if len(shape) > 1 else shape[0]
            start = rank * size if len(shape) > 1 else 0
            regions[n] = tuple(slice(start, start + size) if i == dim else slice(0, s) for i, s in enumerate(shape))
        program = WholeProgram(ctx, regions)
        assert load_checkpoint(program, d, ctx) == STEP
        for n, r in regions.items():
            for suffix in ("", ".exp_avg", ".exp_avg_sq"):
                assert torch.equal(program.loaded[n + suffix], state[n + suffix][r]), (n + suffix, rank)


def test_files_a_crashed_save_staged_go_with_the_next_save(originals, ctx, state, tmp_path):
    """A save killed outright (SIGKILL, power) leaves its staged files (the previous save stays whole); the
    next save removes them, and nothing else of the directory's."""
    d = tmp_path / "ck"
    shutil.copytree(originals["sharded"], d)
    litter = [".model-00002-of-00039.safetensors.k3j_x9a1.tmp", ".optimizer.safetensors.abcdefgh.tmp",
              ".config.json.a1b2c3d4.tmp"]
    kept = [".notes.txt.abcdefgh.tmp", "notes.txt"]
    for name in litter + kept:
        (d / name).write_bytes(b"x")
    assert read_checkpoint_info(d, ctx).step == STEP
    save_to(d, ctx, state, step=STEP + 1)
    assert sorted(p.name for p in d.iterdir()) == sorted(["config.json", WEIGHTS_FILE, OPTIMIZER_FILE, *kept])


@pytest.mark.parametrize("option", ["load", "save"])
def test_a_torchrun_worker_checks_load_and_save_before_its_rendezvous(tmp_path, option):
    """Regression: under torchrun nothing checked --save (the run trained to its end before the writer
    failed) and --load was read only once the world had formed."""
    from runtime.launch import TrainOptions
    from runtime.launch.torchrun import TorchrunEnv, run_torchrun

    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "ck"
    options = TrainOptions(plan=PLAN, **{f"{option}_dir": path})
    with pytest.raises(HspmdError) as err:
        run_torchrun(options, TorchrunEnv(rank=0, world_size=4, local_rank=0, local_world_size=4))
    assert err.value.lines() == [f"{path}: --{option}: " + (
        "no such directory" if option == "load" else f"{tmp_path / 'file'} is not a directory")]
