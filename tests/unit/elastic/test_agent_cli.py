"""`hspmd agent` and `hspmd train --agents`: bad addresses and an unreachable coordinator are one line, exit 2."""

from __future__ import annotations

import socket

from click.testing import CliRunner

from hetu_cli.main import cli


def test_a_malformed_coordinator_address_is_one_line():
    res = CliRunner().invoke(cli, ["agent", "--coordinator", "localhost", "--node", "cpu0", "--token", "t"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1] == ("error: --coordinator: expected HOST:PORT such as "
                                                   "127.0.0.1:29517, got 'localhost'")


def test_an_unreachable_coordinator_is_one_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = CliRunner().invoke(cli, ["agent", "--coordinator", f"127.0.0.1:{port}", "--node", "cpu0", "--token", "t",
                                   "--timeout", "1"])
    assert res.exit_code == 2
    last = res.output.strip().splitlines()[-1]
    assert last.startswith(f"error: --coordinator 127.0.0.1:{port}: cannot reach the coordinator's store")
