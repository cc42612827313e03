"""Fixtures of the in-process unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist


@pytest.fixture
def gloo_world() -> Iterator[dist.ProcessGroup]:
    """A single-process gloo default group (rank 0 of 1, in-memory store), destroyed after the test."""
    assert not dist.is_initialized(), "a previous test left a process group behind"
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[dist.ProcessGroup]:
    """A gloo default group of one rank, in this process, shared by a module's tests (torn down after them)."""
    if dist.is_initialized():  # some other in-process test made one: use it as it is
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
