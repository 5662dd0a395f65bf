"""Shared fixtures: one private Ray cluster per test session, the embedded model."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import pytest

T = TypeVar("T")

# Ray writes a token here when a cluster starts with token auth and none given; what the file
# held before this session's clusters started (a user's own, or none): ours must leave it so.
RAY_TOKEN_FILE = Path.home() / ".ray" / "auth_token"
RAY_TOKEN_FILE_BEFORE = RAY_TOKEN_FILE.read_bytes() if RAY_TOKEN_FILE.is_file() else None

# Modules that start engines or clusters without the session's Ray cluster (a `pdserve serve`
# process, `ray up`, a vLLM engine in the test's own process, a fresh install): `make test-fast`
# leaves them out.
ENGINE_MODULES = frozenset(
    {"test_serve_cli", "test_vs_vllm_bench", "test_install", "test_tuner_validation", "test_deploy_loopback"}
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that starts an engine `engines` (`make test-fast` runs the others), and
    put the modules holding `slow` tests first, so that with two workers (`make test`) no long
    module is left to run alone at the end (xdist's own order, by number of tests, puts the
    one-test multi-host and `ray up` modules last)."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if "ray_cluster" in getattr(item, "fixturenames", ()) or module in ENGINE_MODULES:
            item.add_marker(pytest.mark.engines)
    slow_modules = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow_modules)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def model_path() -> str:
    from vllm_engine.embedded_model import ensure_embedded_model

    return str(ensure_embedded_model())


@pytest.fixture(scope="session")
def ray_cluster() -> Any:
    import ray

    from cluster.ray_cluster import start_local

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
def colocated_engine(ray_cluster, engine_config) -> Any:
    """One colocated engine (no connector: prefill and decode local) for every module's
    reference outputs, started once. Its JSON has no free whitespace (tests/openai_cases.py's
    STAGE_SCHEMA says why); only guided requests see that setting."""
    import dataclasses

    from decode_worker.actor import DecodeActor

    config = dataclasses.replace(engine_config, disable_any_whitespace=True).with_cores("1")
    actor = DecodeActor.remote("colocated", config, None)
    yield actor
    ray_cluster.kill(actor, no_restart=True)


@pytest.fixture(scope="session")
def shared_deployment(ray_cluster, engine_config) -> Any:
    """One 1P+1D deployment of the default engines (JSON without free whitespace, as the
    colocated engine's) for the modules that serve through fronts of their own and leave the
    engines as they found them (an engine start costs about 15 s on the test box). A module
    that kills an engine or needs other settings starts its own deployment."""
    import dataclasses

    from controller.deployment import Deployment, DeploymentConfig

    dep = Deployment(DeploymentConfig(engine=dataclasses.replace(engine_config, disable_any_whitespace=True)))
    run(dep.start())
    yield dep
    dep.shutdown()


@pytest.fixture(scope="session")
def reference(colocated_engine) -> dict[str, Any]:
    """Colocated outputs: same engine configuration, no connector, prefill and decode local."""
    from reference import PROMPTS, reference_runs

    return run(reference_runs(colocated_engine, list(PROMPTS), "ref"))


@pytest.fixture
def sandbox(tmp_path) -> Any:
    """Private network, PID and mount namespaces for a test's cluster of "hosts"."""
    from sandbox import Sandbox

    box = Sandbox(tmp_path)
    yield box
    box.close()


def _engines_idle(dep, but: str = "") -> bool:
    import ray

    for member in dep.prefill.members + dep.decode.members:
        if member.name == but:
            continue
        load = ray.get(member.actor.load.remote())
        if load.running or load.waiting or load.held_for_transfer or load.free_blocks != load.total_blocks:
            return False
    return True


def engine_pid(actor) -> int:
    import ray

    return ray.get(actor.pid.remote())


def sigkill(actor) -> None:
    """SIGKILL an engine actor's process, as a crash would end it (Ray then restarts it)."""
    import os
    import signal

    os.kill(engine_pid(actor), signal.SIGKILL)


def answers(actor) -> bool:
    """The actor answers a call (not dead, not restarting)."""
    import ray

    try:
        ray.get(actor.ready.remote(), timeout=5)
        return True
    except Exception:
        return False


def assert_no_blocks_held(dep, timeout_s: float = 5.0, but: str = "") -> None:
    """No engine of `dep` (`but` the one named: a killed one Ray is restarting) holds a block
    for a request, runs or queues one."""
    assert wait_until(lambda: _engines_idle(dep, but), timeout_s), "blocks still held on an engine"


def engine_counter(actor, metric: str, label: str) -> dict[str, float]:
    """One of an engine actor's labelled Prometheus counters (`metric`_total), by label value."""
    import urllib.request

    import ray
    from prometheus_client.parser import text_string_to_metric_families

    address = ray.get(actor.metrics_address.remote())
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {
        s.labels[label]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == f"{metric}_total"
    }


class ServedStack:
    """A deployment behind the router's gRPC server, which runs on its own loop in a
    background thread as it would in `pdserve serve` (it keeps handling cancellations and
    health polls between a test's client calls)."""

    def __init__(
        self,
        dep,
        model_path: str,
        health_interval_s: float = 0.2,
        front=None,
        credentials=None,
        http_model=None,
        chat=None,
    ) -> None:
        """`http_model`: also serve the OpenAI HTTP API under this model name (`self.http`),
        `chat`: with these tool-call and reasoning parsers (router.chat_parsing.ChatParsers)."""
        import threading

        from controller.local_stack import LocalStack
        from router.security import ClientCredentials

        self.dep = dep
        self.credentials = credentials or ClientCredentials()
        self._owns_engines = dep.orchestrator is None  # else a deployment the caller shares
        if self._owns_engines:
            run(dep.start())
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.stack = LocalStack(
            dep,
            front=front,
            http="127.0.0.1:0" if http_model else None,
            served_model_name=http_model,
            health_interval_s=health_interval_s,
            **({"chat": chat} if chat is not None else {}),
        )
        assert self.stack.model == model_path, (self.stack.model, model_path)
        asyncio.run_coroutine_threadsafe(self.stack.start(), self.loop).result()
        self.server, self.http = self.stack.server, self.stack.http

    def call(self, coro_fn: Callable[[Any], Awaitable[T]], timeout_s: float = 300, credentials=None) -> T:
        """Run a client coroutine on the server's loop (grpc.aio objects are loop-bound)."""

        async def with_channel():
            async with (credentials or self.credentials).channel(self.server.address) as channel:
                return await coro_fn(channel)

        return asyncio.run_coroutine_threadsafe(with_channel(), self.loop).result(timeout=timeout_s)

    def close(self) -> None:
        """Stop serving and the engines it owns (once: a test may close it before its fixture)."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.stack.stop(engines=self._owns_engines), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


async def stream_tokens(channel, request, timeout_s: float | None = None, metadata=()):
    """(token ids, text, final message) of one streamed generation."""
    from router.client import stream_generate

    tokens, texts, final = [], [], None
    async for response in stream_generate(channel, request, timeout_s, metadata):
        if response.HasField("chunk"):
            tokens.extend(response.chunk.token_ids)
            texts.append(response.chunk.text)
        else:
            final = response.final
    return tokens, "".join(texts), final
