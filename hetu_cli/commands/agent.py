"""``hspmd agent --coordinator HOST:PORT --node NAME --token T``: one node's agent of an elastic job.

It starts the workers the coordinator (``hspmd train --elastic --agents N``) asks for on this node and
relays what they say (runtime/elastic/agents.py). It exits 0 when the job ends, 2 when it is refused (a
wrong token, a node the cluster does not name, a node that already has an agent) or the coordinator
cannot be reached or goes away.
"""

from __future__ import annotations

import click

from hetu_cli.output import MAX_TIMEOUT_S, FiniteFloatRange
from runtime.elastic.agents import DEFAULT_PORT, run_agent


@click.command()
@click.option("--coordinator", required=True, metavar="HOST:PORT",
              help=f"Where the coordinator's store listens: its hspmd train --agents N --bind, port "
                   f"{DEFAULT_PORT} unless that says otherwise (the port is always given here).")
@click.option("--node", required=True, help="This node's name in the cluster file.")
@click.option("--token", required=True, help="The job token the coordinator was given.")
@click.option("--timeout", "timeout_s", type=FiniteFloatRange(min=1.0, max=MAX_TIMEOUT_S), default=120.0,
              show_default=True,
              help="Seconds to wait for the coordinator's answer.")
def agent(coordinator: str, node: str, token: str, timeout_s: float) -> None:
    """Run node NAME's workers for the elastic job at HOST:PORT."""
    run_agent(coordinator, node, token, timeout_s=timeout_s, log=lambda m: click.echo(m))
