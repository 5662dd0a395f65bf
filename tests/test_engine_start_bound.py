"""An engine that never finishes starting fails the start, by name, within start_timeout_s
(a stand-in actor handle: a real engine start is in every deployment test)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.pools import Member
from controller.deployment import Deployment, DeploymentConfig
from vllm_engine.config import EngineConfig


class _Ready:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def remote(self):
        return asyncio.sleep(self.seconds)


class _Actor:
    def __init__(self, seconds: float) -> None:
        self.ready = _Ready(seconds)


def test_an_engine_stuck_in_start_up_is_named_within_the_bound():
    deployment = Deployment(DeploymentConfig(engine=EngineConfig(model="m"), start_timeout_s=0.2))
    members = [Member("decode-0", _Actor(0)), Member("decode-1", _Actor(60))]
    with pytest.raises(RuntimeError, match=r"^decode-1: not started within 0.2s"):
        asyncio.run(asyncio.wait_for(deployment._ready(members), 5))


def test_no_engine_to_start_is_no_wait():
    deployment = Deployment(DeploymentConfig(engine=EngineConfig(model="m")))
    asyncio.run(deployment._ready([]))  # a resize that only shrinks
    assert deployment.capacities == {}
