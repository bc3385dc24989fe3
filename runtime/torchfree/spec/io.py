"""Reading and writing spec files: bounded, strict YAML/JSON in, deterministic YAML out, atomic writes.

Every file hspmd reads (plans, clusters, models, profiles, and any later kind) comes in through
``read_yaml`` / ``read_json`` / ``load_file``, so a hostile or broken file fails the same way for every
verb: one line per problem naming the file, exit code 2, never a traceback. The reader bounds what a
file may cost before anything downstream walks it: its size, its nesting depth, and YAML alias use
(count, nesting and expanded size; recursive aliases are refused), and it decodes strictly (UTF-8,
duplicate keys are an error, JSON's NaN/Infinity are refused).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from runtime.torchfree.errors import Problem, SpecError
from runtime.torchfree.spec.schema import build

T = TypeVar("T")


@dataclass(frozen=True)
class ReadLimits:
    """What one input file may cost. Shipped files use a small fraction of each bound."""

    max_bytes: int = 16 * 1024 * 1024
    max_depth: int = 64            # nested mappings/lists
    max_aliases: int = 1000        # YAML alias uses (*name) in one file
    max_alias_nesting: int = 2     # an anchored node may use aliases, whose nodes may not (again)
    max_nodes: int = 250_000       # nodes after expanding every alias (the billion-laughs bound)
    pipe_wait_s: float = 10.0      # a named pipe (FIFO) no one writes to blocked the open forever

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_aliases", "max_alias_nesting", "max_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ReadLimits.{name} must be at least 1")
        if not self.pipe_wait_s > 0:
            raise ValueError("ReadLimits.pipe_wait_s must be positive")


DEFAULT_LIMITS = ReadLimits()


class _Refused(yaml.MarkedYAMLError):
    """A bound of ReadLimits was exceeded, or a strictness rule broken, at ``problem_mark``."""


# libyaml's scanner and parser (C) when PyYAML has them: reading the plan, cluster and model of a verb
# with the pure-Python ones costs more than the rest of ``hspmd validate``. The composer stays PyYAML's
# Python one (below): that is where the bounds are checked.
try:
    from yaml.cyaml import CParser as _PARSER
except ImportError:  # PyYAML built without libyaml
    _PARSER = None


class _BoundedLoader(yaml.composer.Composer, *((_PARSER,) if _PARSER else (yaml.reader.Reader, yaml.scanner.Scanner,
                                                                          yaml.parser.Parser)),
                     yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """A safe loader that counts as it composes: depth, aliases, expanded size, duplicate keys.

    The composer is where aliases are resolved (to shared nodes) and where nesting recurses, so the
    checks sit there, before any Python object is built from the node graph.
    """

    def __init__(self, text: str, limits: ReadLimits) -> None:
        if _PARSER is not None:
            _PARSER.__init__(self, text)
        else:
            yaml.reader.Reader.__init__(self, text)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        self.limits = limits
        self.depth = 0
        self.alias_uses = 0
        self.sizes: dict[int, int] = {}        # id(node) -> nodes after expanding its aliases
        self.nesting: dict[int, int] = {}      # id(node) -> deepest alias chain inside it
        self.open_nesting: list[int] = []      # the same, for collections still being composed

    def refuse(self, mark: yaml.Mark | None, message: str) -> None:
        raise _Refused(problem=message, problem_mark=mark)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None:
                lim = self.limits
                self.alias_uses += 1
                if self.alias_uses > lim.max_aliases:
                    self.refuse(event.start_mark, f"more than {lim.max_aliases} YAML aliases (hspmd reads "
                                                  f"at most {lim.max_aliases} per file)")
                if id(target) not in self.sizes:
                    self.refuse(event.start_mark, f"alias *{event.anchor} is used inside its own anchor "
                                                  "(a recursive structure)")
                level = self.nesting[id(target)] + 1
                if level > lim.max_alias_nesting:
                    self.refuse(event.start_mark, f"YAML aliases nested {level} deep (alias *{event.anchor} "
                                                  f"refers to a node that uses aliases; hspmd reads at most "
                                                  f"{lim.max_alias_nesting} levels)")
                if self.open_nesting:
                    self.open_nesting[-1] = max(self.open_nesting[-1], level)
            return super().compose_node(parent, index)
        if self.check_event(yaml.ScalarEvent):
            node = super().compose_node(parent, index)
            self.sizes[id(node)] = 1
            self.nesting[id(node)] = 0
            return node
        self.depth += 1
        if self.depth > self.limits.max_depth:
            self.refuse(self.peek_event().start_mark, f"nested more than {self.limits.max_depth} levels deep "
                                                      f"(hspmd reads at most {self.limits.max_depth})")
        self.open_nesting.append(0)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
            inner = self.open_nesting.pop()
        if self.open_nesting:
            self.open_nesting[-1] = max(self.open_nesting[-1], inner)
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
        size = 1 + sum(self.sizes[id(c)] for c in children)
        if size > self.limits.max_nodes:
            # A plain file that large is no alias bomb: say so (65,536 one-device nodes were "an alias bomb?").
            self.refuse(node.start_mark, f"YAML aliases expand to more than {self.limits.max_nodes:,} nodes "
                                         "(an alias bomb?)" if self.alias_uses else
                        f"more than {self.limits.max_nodes:,} YAML values (hspmd reads at most that many per file)")
        self.sizes[id(node)] = size
        self.nesting[id(node)] = inner
        return node

    def compose_mapping_node(self, anchor: str | None) -> yaml.MappingNode:
        node = super().compose_mapping_node(anchor)
        seen: dict[tuple[str, str], yaml.Node] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            first = seen.setdefault((key.tag, key.value), key)
            if first is not key:
                self.refuse(key.start_mark, f"duplicate key {key.value!r} (first at line {first.start_mark.line + 1})")
        return node


def is_file(path: str | os.PathLike[str]) -> bool:
    """``Path.is_file`` that answers False, not an OSError (a traceback), for a name no file can have: a
    component longer than the file system allows, a path through a file the OS refuses (Python 3.11's
    pathlib passes ENAMETOOLONG and EACCES on)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):   # ValueError: an embedded NUL byte
        return False


def is_dir(path: str | os.PathLike[str]) -> bool:
    """``Path.is_dir`` with ``is_file``'s answer for names no directory can have."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _open_pipe(p: Path, limits: ReadLimits) -> Any:
    """A named pipe, opened without blocking and read once a writer has written or closed it (within
    ``pipe_wait_s``). A plain open() of a FIFO that no one writes to never returns: every verb hung."""
    import select

    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        if not poller.poll(limits.pipe_wait_s * 1000):
            raise SpecError([Problem(str(p), "", f"a named pipe that nothing wrote to within {limits.pipe_wait_s:g} "
                                                 "s (give a file)")])
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_bytes(p: Path, limits: ReadLimits) -> bytes:
    try:
        with (_open_pipe(p, limits) if stat.S_ISFIFO(os.stat(p).st_mode) else open(p, "rb")) as f:
            data = f.read(limits.max_bytes + 1)
    except FileNotFoundError:
        raise SpecError([Problem(str(p), "", "file not found")]) from None
    except IsADirectoryError:
        raise SpecError([Problem(str(p), "", "is a directory, expected a file")]) from None
    except OSError as exc:
        raise SpecError([Problem(str(p), "", f"cannot read: {exc.strerror or exc}")]) from None
    if len(data) > limits.max_bytes:
        raise SpecError([Problem(str(p), "", f"larger than {limits.max_bytes:,} bytes (hspmd reads at most "
                                             f"{limits.max_bytes:,} per file)")])
    return data


def _decode(p: Path, data: bytes) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise SpecError([Problem(str(p), f"line {line}", f"not UTF-8 text (byte 0x{data[exc.start]:02x} at "
                                                         f"offset {exc.start})")]) from None
    return text.removeprefix("\ufeff")


def read_text(path: str | os.PathLike[str], limits: ReadLimits = DEFAULT_LIMITS) -> str:
    """A text file (e.g. a CSV table) under the same size bound and strict UTF-8 decoding."""
    p = Path(path)
    return _decode(p, _read_bytes(p, limits))


def read_yaml(path: str | os.PathLike[str], limits: ReadLimits = DEFAULT_LIMITS) -> Any:
    """Parse one YAML document with a bounded ``SafeLoader``; any problem is one SpecError line."""
    p = Path(path)
    text = _decode(p, _read_bytes(p, limits))
    loader = None
    try:
        loader = _BoundedLoader(text, limits)  # the reader rejects control characters here already
        return loader.get_single_data()
    except yaml.reader.ReaderError as exc:
        line = text[:exc.position].count("\n") + 1
        raise SpecError([Problem(str(p), f"line {line}", f"malformed YAML: character #x{exc.character:04x} "
                                                         "is not allowed")]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        kind = "refused YAML" if isinstance(exc, _Refused) else "malformed YAML"
        if what == "exceeded maximum nesting depth":  # libyaml's own bound (1000), met before ours
            kind, what = "refused YAML", (f"nested more than {limits.max_depth} levels deep (hspmd reads at "
                                          f"most {limits.max_depth})")
        raise SpecError([Problem(str(p), where, f"{kind}: {what}")]) from None
    except (ValueError, OverflowError) as exc:
        # e.g. an integer of more digits than Python converts, or a malformed timestamp.
        raise SpecError([Problem(str(p), "", f"malformed YAML: {str(exc).splitlines()[0][:120]}")]) from None
    finally:
        if loader is not None:
            loader.dispose()


def _json_depth(text: str) -> tuple[int, int]:
    """Deepest bracket nesting outside strings, and the line where it is first reached.

    Python's json decoder recurses once per level; measuring first keeps a deep file a user error.
    """
    depth = deepest = 0
    line = at = 1
    in_string = escaped = False
    for ch in text:
        if ch == "\n":
            line += 1
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest, at = depth, line
        elif ch in "]}":
            depth -= 1
    return deepest, at


def read_json(path: str | os.PathLike[str], limits: ReadLimits = DEFAULT_LIMITS) -> Any:
    """Parse a JSON file (e.g. a Hugging Face config.json) under the same bounds and strictness."""
    p = Path(path)
    text = _decode(p, _read_bytes(p, limits))
    deepest, at = _json_depth(text)
    if deepest > limits.max_depth:
        raise SpecError([Problem(str(p), f"line {at}", f"nested more than {limits.max_depth} levels deep "
                                                       f"(hspmd reads at most {limits.max_depth})")])

    import json  # here: most verbs read no JSON, and start-up counts (docs/design.md §8)

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise ValueError(f"duplicate key {k!r}")
            out[k] = v
        return out

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise SpecError([Problem(str(p), f"line {exc.lineno}, column {exc.colno}",
                                 f"malformed JSON: {exc.msg}")]) from None
    except (ValueError, RecursionError) as exc:
        raise SpecError([Problem(str(p), "", f"malformed JSON: {str(exc).splitlines()[0][:120]}")]) from None


def check_version(data: Any, supported: int, file: str, field: str = "version") -> None:
    """Refuse a file of another format version before anything else of it is read: a newer file's
    other problems would only be noise (its fields may have changed meaning)."""
    if not isinstance(data, dict):
        return
    if field not in data:
        raise SpecError([Problem(file, field, f"missing required field (this hspmd reads version {supported})")])
    found = data[field]
    if not isinstance(found, int) or isinstance(found, bool):
        shown = repr(found) if len(repr(found)) <= 40 else repr(found)[:37] + "..."
        raise SpecError([Problem(file, field, f"expected an integer, got {shown} ({type(found).__name__})")])
    if found > supported:
        raise SpecError([Problem(file, field, f"version {found} is newer than this hspmd reads ({supported})")])
    if found != supported:
        raise SpecError([Problem(file, field, f"version {found} is not one this hspmd reads ({supported})")])


def load_file(cls: type[T], path: str | os.PathLike[str], *, version: int | None = None,
              limits: ReadLimits = DEFAULT_LIMITS) -> T:
    """Read ``path`` (bounded, strict), check its ``version`` first if the format has one, and build
    ``cls`` from it, every problem with its field path."""
    file = str(path)
    data = (read_json if Path(path).suffix.lower() == ".json" else read_yaml)(path, limits)
    if data is None:
        raise SpecError([Problem(file, "", "is empty, expected a mapping")])
    if version is not None:
        check_version(data, version, file)
    return build(cls, data, file)


def dump_yaml(data: Any) -> str:
    """Deterministic block YAML with inline lists of scalars (``layers: [0, 3]``)."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) so that readers see either the old file or the whole new one."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it over ``path``.

    A target that cannot be written (a directory, a path under a file, a read-only or pseudo file system, a
    name too long, a full disk) is one SpecError naming it, and the directories this write created for it
    are removed again: nothing is left behind."""
    atomic_write_files([(path, data)])


def atomic_write_files(items: list[tuple[str | os.PathLike[str], bytes]]) -> None:
    """Several files replaced together (``AtomicFiles``): all of them written, or none (e.g. ``hspmd plan -o
    P --symmetric-out S`` when S cannot be written leaves no P either)."""
    created = {d: None for path, _ in items for d in Path(path).parents if not os.path.lexists(d)}
    target = ""
    try:
        with AtomicFiles() as files:
            for path, data in items:
                target = str(path)
                files.write(path, data)
            target = ""  # past here only the renames fail: the error's filename2 is the target
    except OSError as exc:
        for d in sorted(created, key=lambda d: len(d.parts), reverse=True):  # deepest first
            with contextlib.suppress(OSError):
                d.rmdir()
        raise SpecError([Problem(target or str(exc.filename2 or items[-1][0]), "",
                                 f"cannot write: {why_not(exc)}")]) from None


def why_not(exc: OSError) -> str:
    """An OS error as the words a one-line user error ends with."""
    if isinstance(exc, IsADirectoryError):
        return "is a directory, expected a file name"
    return exc.strerror or str(exc)


def not_replaceable(path: Path) -> str | None:
    """Why an existing ``path`` must not be replaced by a new file, None if it may (a regular file, a link, or
    nothing there; a directory is refused on its own). A new file is renamed over its target: ``hspmd plan -o
    /dev/null`` run as root replaced the device node with the plan (every later write to /dev/null then landed
    in that file), and a named pipe or socket someone reads from would vanish the same way."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode) or stat.S_ISDIR(mode):
        return None
    kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "no regular file")
    return f"is {kind}, expected a regular file (hspmd writes a new file and renames it over the old one)"


def check_output_file(path: str | os.PathLike[str], option: str) -> None:
    """Refuse, before any work, an output file that cannot be written: a directory, a name too long, a
    path whose nearest existing ancestor is a file or not writable. (Mode bits are as the OS reports them:
    root writes through them. What only the write itself finds out, e.g. a pseudo file system, is refused by
    ``atomic_write_bytes`` without writing anything.)"""
    p = Path(path)
    try:
        os.lstat(p)
    except FileNotFoundError:
        pass
    except OSError as exc:   # ENAMETOOLONG, ENOTDIR (a file on the way), ELOOP, EACCES
        raise SpecError([Problem(str(p), option, f"cannot write: {why_not(exc)}")]) from None
    if p.is_dir():
        raise SpecError([Problem(str(p), option, "is a directory, expected a file name")])
    why = not_replaceable(p)
    if why is not None:
        raise SpecError([Problem(str(p), option, why)])
    existing = next(a for a in p.absolute().parents if os.path.lexists(a))
    if not existing.is_dir():
        raise SpecError([Problem(str(p), option, f"cannot write: {existing} is not a directory")])
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpecError([Problem(str(p), option, f"cannot write: {existing} is not writable")])


def check_append_file(path: str | os.PathLike[str], option: str) -> None:
    """Refuse, before any work, a file to append lines to (``--metrics``) that cannot be opened for writing: a
    directory, a file on the way, an unwritable place. Unlike ``check_output_file`` a device or a pipe is fine
    (the lines are written into it, not renamed over it: ``--metrics /dev/stdout``)."""
    p = Path(path)
    try:
        os.lstat(p)
        exists = True
    except FileNotFoundError:
        exists = False
    except OSError as exc:   # ENAMETOOLONG, ENOTDIR (a file on the way), ELOOP, EACCES
        raise SpecError([Problem(str(p), option, f"cannot write: {why_not(exc)}")]) from None
    if p.is_dir():
        raise SpecError([Problem(str(p), option, "is a directory, expected a file name")])
    if exists:
        if not os.access(p, os.W_OK):
            raise SpecError([Problem(str(p), option, "cannot write: not writable")])
        return
    existing = next(a for a in p.absolute().parents if os.path.lexists(a))
    if not existing.is_dir():
        raise SpecError([Problem(str(p), option, f"cannot write: {existing} is not a directory")])
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpecError([Problem(str(p), option, f"cannot write: {existing} is not writable")])


def check_output_dir(path: str | os.PathLike[str], option: str) -> None:
    """Refuse, before any work, an output directory that cannot be made or written into: an existing file
    there, a file on the way, a nearest existing ancestor that is not writable."""
    p = Path(path)
    try:
        os.lstat(p)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise SpecError([Problem(str(p), option, f"cannot write: {why_not(exc)}")]) from None
    if os.path.lexists(p) and not p.is_dir():
        raise SpecError([Problem(str(p), option, "is a file, expected a directory")])
    existing = next(a for a in (p.absolute(), *p.absolute().parents) if os.path.lexists(a))
    if not existing.is_dir():
        raise SpecError([Problem(str(p), option, f"cannot write: {existing} is not a directory")])
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpecError([Problem(str(p), option, f"cannot write: {existing} is not writable")])


class AtomicFiles:
    """Files replaced together. Each is written and fsynced under a temporary name beside its target; the
    renames over the targets come only once every file is written (leaving the ``with`` block without an
    exception). So a failure while writing (a full disk, an error in the writer) leaves every target as it
    was and no temporary file behind; only a crash during the renames, microseconds, can leave some
    replaced, which readers that care detect by tying the files together (the checkpoint's save id)."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, Path]] = []  # (temporary file, target)

    def write(self, path: str | os.PathLike[str], data: bytes) -> None:
        import tempfile  # here: ~5 ms of start-up that verbs which write nothing need not pay

        p = Path(path)
        why = not_replaceable(p)  # the backstop of check_output_file, for writers that did not call it
        if why is not None:
            raise OSError(errno.EINVAL, why, str(p))
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        self.pending.append((tmp, p))
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp creates 0600: the mode a plain open() gives
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def __enter__(self) -> AtomicFiles:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        try:
            while kind is None and self.pending:
                tmp, target = self.pending[0]
                os.replace(tmp, target)
                self.pending.pop(0)
        finally:
            for tmp, _target in self.pending:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            self.pending.clear()
