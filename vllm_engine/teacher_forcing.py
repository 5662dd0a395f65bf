"""Teacher forcing: a request that names its continuation emits exactly those tokens, and
reports for each the logprobs the model itself gave (vLLM's default `raw_logprobs` mode
computes them before any logits processor runs).

Equivalence checks need it: comparing two serving paths token by token stops at the first
near-tie, where bf16 noise may pick either token; forced along one continuation, both paths
score the same positions however close the candidates are. vLLM has no such sampling
option, so this is a per-request logits processor (vLLM's `AdapterLogitsProcessor`), loaded
by every engine and idle for requests that force nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from vllm_engine.sampling import FORCED_TOKENS_KEY

if TYPE_CHECKING:
    from vllm import SamplingParams


class TeacherForcing(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False  # it replaces the argmax

    def new_req_logits_processor(self, params: "SamplingParams") -> Callable[[list[int], Any], Any] | None:
        forced = (params.extra_args or {}).get(FORCED_TOKENS_KEY)
        if not forced:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step >= len(forced):
                return logits
            only = torch.full_like(logits, float("-inf"))
            only[forced[step]] = 0.0
            return only

        return force
