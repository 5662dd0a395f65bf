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
