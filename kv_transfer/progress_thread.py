"""NIXL progress-thread setting, which vLLM 0.32's NixlConnector does not expose.

NixlConnector builds its NIXL agent with `nixl_agent_config(...)` and stock NIXL then runs
a progress thread that busy-polls with no delay: a full core per engine. Where cores are
scarce (CPU serving, this project's tests) we turn it off; vLLM's worker still drives
transfers forward, because it polls transfer and notification state every engine step.
Call before the engine is created, in the engine's own process (the patch is process-wide).
"""

from __future__ import annotations

import functools


def set_nixl_progress_thread(enabled: bool) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    original = getattr(base_worker.nixl_agent_config, "func", base_worker.nixl_agent_config)
    if original is None:  # NIXL not installed: NixlConnector will report it itself
        return
    base_worker.nixl_agent_config = functools.partial(original, enable_prog_thread=enabled)
