"""The ``hspmd`` click application. Each verb lives in hetu_cli/commands/<verb>.py.

Verbs are imported when they are invoked (or listed by ``--help``), not at start-up: a verb that does not
train must not pay for torch and the engine (docs/design.md §8), and one verb's imports stay its own.
"""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

import click

from hetu_cli.output import fail, printable
from runtime.torchfree.errors import HspmdError

# verb -> module in hetu_cli.commands holding a click command of the same name (``-`` becomes ``_``).
# A verb is listed here once it works.
COMMANDS: tuple[str, ...] = ("validate", "show", "train", "simulate", "profile", "plan", "replan", "export",
                             "check-numerics", "agent", "data")


class HspmdGroup(click.Group):
    """Loads verbs on demand; turns user errors raised anywhere below into one line each and exit code 2."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        attr = name.replace("-", "_")
        return getattr(importlib.import_module(f"hetu_cli.commands.{attr}"), attr)

    def make_context(self, info_name, args, parent=None, **extra):  # type: ignore[override]
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as err:
            usage_error(err)

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except click.ClickException as err:   # a verb's options or arguments, parsed in here
            usage_error(err)
        except HspmdError as err:
            fail(err)
        except OSError as err:
            # A backstop: an OS error on a path the user gave (permissions, a name no file can have) that no
            # check met first is still one line naming the path, not a traceback. One with no path is a bug.
            if err.filename is None:
                raise
            fail(f"{err.filename}: {err.strerror or err}")


def usage_error(err: click.ClickException) -> NoReturn:
    """Click's own errors (a bad option value, a missing argument) in the one-line ``error: ...`` form of every
    other user error, with the exit status click gives them (2 for usage errors)."""
    where = ""
    ctx = getattr(err, "ctx", None)
    if isinstance(err, click.UsageError) and ctx is not None:
        where = f" (see '{ctx.command_path} --help')"
    click.echo(f"error: {printable(err.format_message())}{where}", err=True)
    sys.exit(err.exit_code)


@click.group(cls=HspmdGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hspmd")
def cli() -> None:
    """hspmd: plan and run LLM training on heterogeneous, failure-prone GPU clusters."""


def main() -> None:
    cli(prog_name="hspmd")
