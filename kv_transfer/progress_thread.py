"""NIXL progress-thread setting, which vLLM 0.32's NixlConnector does not expose.

Why it matters: a READ over UCX on host memory (and over TCP) needs the *producer's* UCX
worker to make progress. Without a progress thread only vLLM's engine step drives it, so a
pull that arrives while the producer runs the next prefill waits for that whole step.

NIXL's UCX progress thread sleeps in poll() on the UCX workers' event fds, waking on
traffic or after `pthrDelay` (rounded up to whole ms). nixl's Python agent hard-codes the
delay to 0, which makes poll() return at once: a thread spinning a full core. We pass our
own delay instead, so transfers progress while the engine computes, at almost no CPU.
Call before the engine is created, in the engine's own process (the patch is process-wide).
"""

from __future__ import annotations

import functools
from typing import Any

# "none": no progress thread; "0": NIXL's spinning thread; N: asleep in poll(), N us at most.
PROGRESS_POLL_ENV = "PDSERVE_NIXL_PROGRESS_POLL_US"


def configure_nixl_progress_thread(poll_timeout_us: int | None) -> None:
    """None: no progress thread (the engine step drives transfers); 0: NIXL's spinning
    thread; otherwise a thread that sleeps in poll() for at most this long (>= 1000 us)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    original = getattr(base_worker.nixl_agent_config, "func", base_worker.nixl_agent_config)
    if original is None:  # NIXL not installed: NixlConnector will report it itself
        return
    base_worker.nixl_agent_config = functools.partial(original, enable_prog_thread=poll_timeout_us is not None)
    if poll_timeout_us:
        _set_poll_timeout(poll_timeout_us)


def _set_poll_timeout(poll_timeout_us: int) -> None:
    import nixl._api as nixl_api

    bindings = nixl_api.nixlBind
    agent_class = getattr(bindings.nixlAgent, "__wrapped__", bindings.nixlAgent)

    @functools.wraps(agent_class)
    def agent_with_delay(name: str, config: Any) -> Any:
        config.pthrDelay = poll_timeout_us
        return agent_class(name, config)

    bindings.nixlAgent = agent_with_delay
