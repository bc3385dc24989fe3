"""The ``hspmd`` click application. Each verb lives in hetu_cli/commands/<verb>.py."""

from __future__ import annotations

import importlib

import click

from hetu_cli.output import fail
from runtime.errors import HspmdError

# (module in hetu_cli.commands, command object name). A verb is listed here once it works.
COMMANDS: list[tuple[str, str]] = [
    ("validate", "validate"),
    ("show", "show"),
    ("train", "train"),
    ("simulate", "simulate"),
    ("profile", "profile"),
    ("plan", "plan"),
    ("replan", "replan"),
    ("check_numerics", "check_numerics"),
]


class HspmdGroup(click.Group):
    """Turns user errors raised anywhere below into one line per problem and exit code 2."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except HspmdError as err:
            fail(err)


@click.group(cls=HspmdGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hspmd")
def cli() -> None:
    """hspmd: plan and run LLM training on heterogeneous, failure-prone GPU clusters."""


for _module, _name in COMMANDS:
    cli.add_command(getattr(importlib.import_module(f"hetu_cli.commands.{_module}"), _name))


def main() -> None:
    cli(prog_name="hspmd")
