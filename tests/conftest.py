"""Shared fixtures: one private Ray cluster per test session, the embedded model."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, TypeVar

import pytest

T = TypeVar("T")


@pytest.fixture(scope="session")
def model_path() -> str:
    from vllm_engine.embedded_model import ensure_embedded_model

    return str(ensure_embedded_model())


@pytest.fixture(scope="session")
def ray_cluster() -> Any:
    import ray

    from router.ray_cluster import start_local

    start_local()
    yield ray
    ray.shutdown()


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def wait_until(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


@pytest.fixture(scope="session")
def engine_config(model_path) -> Any:
    from vllm_engine.config import EngineConfig

    return EngineConfig(model=model_path)


@pytest.fixture(scope="session")
def reference(ray_cluster, engine_config) -> dict[str, Any]:
    """Colocated outputs: same engine configuration, no connector, prefill and decode local."""
    from reference import PROMPTS, make_request, reference_run

    from decode_worker.actor import DecodeActor

    actor = DecodeActor.remote("colocated", engine_config.with_cores("1"), None)
    try:
        return {name: run(reference_run(actor, make_request(name, f"ref-{name}", logprobs=2))) for name in PROMPTS}
    finally:
        ray_cluster.kill(actor, no_restart=True)


def _engines_idle(dep) -> bool:
    import ray

    for member in dep.prefill.members + dep.decode.members:
        load = ray.get(member.actor.load.remote())
        if load.running or load.waiting or load.held_for_transfer or load.free_blocks != load.total_blocks:
            return False
    return True


def assert_no_blocks_held(dep, timeout_s: float = 5.0) -> None:
    assert wait_until(lambda: _engines_idle(dep), timeout_s), "blocks still held on an engine"
