"""Methods pdserve calls on every rank of an engine (vLLM's `worker_extension_cls`, through
`collective_rpc`): the ranks hold the KV cache, the engine's own process may not."""

from __future__ import annotations

from typing import Any

WORKER_EXTENSION = f"{__name__}.RankMethods"


class RankMethods:
    def pdserve_state_layout(self) -> dict[str, Any]:
        from kv_transfer.layout import StateLayout

        runner = self.model_runner  # type: ignore[attr-defined]
        return StateLayout.from_kv_cache_config(runner.kv_cache_config, vllm_config=runner.vllm_config).to_dict()

    def pdserve_transfer_digests(self, logical_block_ids: list[list[int]]) -> list[list[list[int]]]:
        """This rank's digests of a finished request's held blocks (kv_transfer.digests)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kv_transfer.digests import to_wire

        groups = get_kv_transfer_group().producer_digests(logical_block_ids)
        return to_wire([groups])[0]
