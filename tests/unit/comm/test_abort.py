"""Ending a world (runtime/comm/abort.py): every group aborted at once leaves torch's registry empty and its
group counter reset, so the next world forms and names its groups as on a fresh process; what NCCL workers
of each kind of run set before their first group."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from runtime.comm.abort import NCCL_ERROR_HANDLING, abort_world, apply_nccl_environment, nccl_environment


def _world() -> list[str]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
    return [dist.new_group([0]).group_name for _ in range(2)]


def test_an_aborted_world_is_gone_and_the_next_one_names_its_groups_alike():
    first = _world()
    abort_world(shut_connections=False, keep_port=0)
    assert not dist.is_initialized()
    abort_world(shut_connections=False, keep_port=0)  # nothing left: harmless
    second = _world()
    try:
        assert second == first  # the counter restarted: every member of a new world agrees on the names
    finally:
        dist.destroy_process_group()


def test_elastic_nccl_workers_abort_communicators_without_exiting(monkeypatch):
    assert nccl_environment(elastic=False) == {}  # a plain run keeps torch's default: a failure ends it
    assert nccl_environment(elastic=True) == {NCCL_ERROR_HANDLING: "2"}
    monkeypatch.delenv(NCCL_ERROR_HANDLING, raising=False)
    assert apply_nccl_environment(elastic=True) is None and os.environ[NCCL_ERROR_HANDLING] == "2"
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "3")
    line = apply_nccl_environment(elastic=True)
    assert line is not None and "=3 replaced by 2" in line and os.environ[NCCL_ERROR_HANDLING] == "2"


def test_a_plain_run_sets_nothing(monkeypatch):
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "3")
    assert apply_nccl_environment(elastic=False) is None and os.environ[NCCL_ERROR_HANDLING] == "3"
