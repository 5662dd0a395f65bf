"""Decode's in-place dim-first conv update (vllm_engine.conv_state_update) against vLLM's own
staged path: the kernel on its own, then a real engine generating with each."""

import json
import platform
import subprocess
import sys
import textwrap

import pytest
from reference import MIN_COMPARED, NEAR_TIE_NATS


def _vllm_runs_its_cpp_conv() -> bool:
    """vLLM's own predicate (gdn_attention.py): its C++ conv update, the path ours replaces,
    runs only on AVX512-BF16 x86 or bf16 aarch64 CPUs; elsewhere it uses a torch kernel."""
    import torch

    return torch.cpu._is_avx512_bf16_supported() or platform.machine() == "aarch64"


needs_cpp_conv = pytest.mark.skipif(
    not _vllm_runs_its_cpp_conv(),
    reason="this CPU has no AVX512-BF16: vLLM decodes with its torch conv kernel, "
    "which the in-place update leaves alone",
)

KERNEL_CHECK = """
import torch
import vllm._custom_ops as ops
import vllm.forward_context as forward_context
import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn
from vllm_engine.conv_state_update import install

staged = gdn._causal_conv1d_update_cpu
install()
torch.manual_seed(0)
dim, state, slots, slot_stride = 512, 3, 64, 4096  # the embedded model's GDN conv shape
raw = torch.randn(slots * slot_stride, dtype=torch.bfloat16)
weight = torch.randn(dim, 4, dtype=torch.bfloat16) * 0.3
packed = torch.nn.Parameter(ops.causal_conv1d_weight_pack(weight.clone()), requires_grad=False)
conv = torch.nn.Module()
conv.weight, conv._cpu_unpacked_conv_weight = packed, weight
layer = torch.nn.Module()
layer.conv1d = conv

class Context:
    no_compile_layers = {"layer": layer}

forward_context.get_forward_context = lambda: Context  # what the engine's forward provides
report = {}
for batch in (1, 3, 8):
    indices = (torch.randperm(slots - 1)[:batch] + 1).to(torch.int32)
    x = torch.randn(batch, dim, dtype=torch.bfloat16)
    results = []
    for update in (staged, gdn._causal_conv1d_update_cpu):
        states = raw.clone()
        out = update(x=x.clone(), conv_states=states.as_strided((slots, dim, state), (slot_stride, state, 1)),
                     weight=packed, bias=None, silu_activation=True, conv_state_indices=indices, is_weight_packed=True)
        results.append((out.float(), states))
    (out_staged, states_staged), (out_in_place, states_in_place) = results
    report[batch] = {"states_equal": torch.equal(states_staged, states_in_place),
                     "max_out_diff": (out_staged - out_in_place).abs().max().item(),
                     "max_out": out_staged.abs().max().item()}
print(json.dumps(report))
"""

ENGINE_CHECK = """
import os
os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_SSM_CONV_STATE_LAYOUT": "DS"})
import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn
from vllm import SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine
from vllm_engine.config import EngineConfig
from vllm_engine.conv_state_update import install
from reference import PROMPTS

engine = LLMEngine.from_engine_args(EngineConfig(max_num_seqs=4).engine_args())
params = SamplingParams(max_tokens=80, ignore_eos=True, temperature=0, logprobs=2)

def generate(tag):
    for name in ("short", "long", "x"):  # decoded together: batches of 3 conv updates
        engine.add_request(f"{tag}-{name}", {"prompt_token_ids": list(PROMPTS[name])}, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                margins = [sorted((lp.logprob for lp in pos.values()), reverse=True) for pos in completion.logprobs]
                done[output.request_id.split("-", 1)[1]] = (list(completion.token_ids), [m[0] - m[1] for m in margins])
    return done

staged = generate("staged")
calls = []
install()
in_place_update = gdn._causal_conv1d_update_cpu
def counting(**kwargs):
    calls.append(1)
    return in_place_update(**kwargs)
gdn._causal_conv1d_update_cpu = counting
print(json.dumps({"staged": staged, "in_place": generate("inplace"), "in_place_calls": len(calls)}))
"""


def _run(code: str) -> dict:
    script = "import json, sys\nsys.path.insert(0, 'tests')\n" + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_cpp_conv
def test_in_place_update_leaves_the_staged_paths_state_and_output():
    """Same new conv state, bit for bit; outputs within bf16 rounding (1-2 ulps of the largest
    output: the kernels accumulate in a different order), for batches of 1, 3 and 8."""
    for batch, found in _run(KERNEL_CHECK).items():
        assert found["states_equal"], batch
        assert found["max_out_diff"] <= 2**-6 * found["max_out"], (batch, found)


@needs_cpp_conv
def test_engine_decodes_the_same_tokens_with_the_in_place_update():
    """A real vLLM engine (embedded model, DS layout, three requests decoded together) with
    vLLM's staged update and then with ours: greedy tokens agree up to the staged run's first
    near-tie, at least MIN_COMPARED tokens per request (and ours did run)."""
    found = _run(ENGINE_CHECK)
    assert found["in_place_calls"] > 0
    for name, (tokens, margins) in found["staged"].items():
        decisive = next((i for i, m in enumerate(margins) if m < NEAR_TIE_NATS), len(tokens))
        assert decisive >= MIN_COMPARED, (name, decisive)
        assert found["in_place"][name][0][:decisive] == tokens[:decisive], name
