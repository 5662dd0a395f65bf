"""Decoding keeps a hybrid's last state checkpoints (vllm_engine.decode_checkpoints), on a real
vLLM engine with pdserve's arguments, in a process of its own (the patch is process-wide).

A prompt just past a block, then an answer crossing three more block ends: vLLM alone keeps a
checkpoint at each (a block per DeltaNet group each); patched, the prompt's and the last two.
The next turn (prompt, answer, a new message) still resumes at the last block end decoded
past, with the next-token distribution it gets without any cache."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHECK = """
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import dataclasses, random
from vllm import LLM, SamplingParams
from vllm.v1.kv_cache_interface import MambaSpec
from vllm_engine.config import EngineConfig
from vllm_engine.decode_checkpoints import KEPT, install

if sys.argv[1] == "patched":
    install()
args = EngineConfig(model=sys.argv[2], max_num_seqs=4).engine_args(checkpoint_interval=int(sys.argv[3]))
llm = LLM(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init})
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
pool = scheduler.kv_cache_manager.block_pool
groups = scheduler.kv_cache_config.kv_cache_groups
state_groups = {i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)}
block = groups[0].kv_cache_spec.block_size

def state_blocks():
    return sum(1 for b in pool.blocks if b.block_hash is not None and
               int.from_bytes(bytes(b.block_hash)[-4:], "big") in state_groups)

rnd = random.Random(3)
prompt = [rnd.randrange(10, 2000) for _ in range(block + 40)]
greedy = SamplingParams(max_tokens=3 * block, temperature=0, ignore_eos=True)
before = state_blocks()
answer = list(llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids)
kept = (state_blocks() - before) // len(state_groups)
turn2 = prompt + answer + [rnd.randrange(10, 2000) for _ in range(40)]
first = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
hit = llm.generate([{"prompt_token_ids": turn2}], first, use_tqdm=False)[0]
fresh = llm.generate([{"prompt_token_ids": turn2, "cache_salt": "none"}], first, use_tqdm=False)[0]

def top(output):
    return {str(token): lp.logprob for token, lp in output.outputs[0].logprobs[0].items()}

print(json.dumps({"block": block, "kept": kept, "KEPT": KEPT, "cached": hit.num_cached_tokens,
                  "fresh_cached": fresh.num_cached_tokens, "hit_top": top(hit), "fresh_top": top(fresh),
                  "ends": len(prompt + answer) // block * block}))
"""


def _run(kind: str, model_path: str, checkpoint_tokens: int) -> dict:
    """`kind` "patched" or "vllm"; checkpoints every `checkpoint_tokens` (whole blocks of the
    size this CPU's state dtype gives: 256 or 128 tokens)."""
    script = "import json, sys\n" + textwrap.dedent(CHECK)
    args = [kind, model_path, str(checkpoint_tokens)]
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_decoding_keeps_its_last_checkpoints_and_the_next_turn_resumes_there(model_path):
    found = _run("patched", model_path, 512)
    block = found["block"]
    # The prompt (block + 40 tokens) keeps its checkpoint at its one whole block; the answer
    # passes 3 more block ends: the last KEPT of them stay (vLLM alone keeps all 3).
    assert found["kept"] == 1 + found["KEPT"], found
    assert found["cached"] == found["ends"] == 4 * block, found
    # The next token's distribution from the kept state, against the whole turn computed
    # afresh (another cache salt): the same top tokens, within bf16 rounding.
    hit, fresh = found["hit_top"], found["fresh_top"]
    assert found["fresh_cached"] == 0 and len(hit.keys() & fresh.keys()) >= 4, found
    assert max(abs(hit[t] - fresh[t]) for t in hit.keys() & fresh.keys()) < 0.1, found
