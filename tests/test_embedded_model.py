"""The embedded model is built deterministically, has the promised hybrid shape, and has
learned its corpus: greedy decoding in vLLM reproduces it, with clear margins."""

import asyncio
import hashlib
import json
from pathlib import Path

from conftest import run
from reference import NEAR_TIE_NATS, reference_run

from messages.requests import GenerateRequest, SamplingConfig
from vllm_engine.embedded_model import EmbeddedModelSpec, ensure_embedded_model
from vllm_engine.embedded_model.texts import token_stream
from vllm_engine.embedded_model.train import TrainingRecipe

PROMPTS = 10
PROMPT_TOKENS = 32
CONTINUATION = 128


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_build_is_deterministic_and_cached(tmp_path):
    # A few training steps of a smaller model: the same seed gives the same bytes.
    training = TrainingRecipe(steps=3, batch_size=2, seq_len=64)
    spec = EmbeddedModelSpec(hidden_size=128, intermediate_size=256, vocab_size=600, training=training)
    first = ensure_embedded_model(spec, tmp_path / "a")
    second = ensure_embedded_model(spec, tmp_path / "b")
    assert _digest(first) == _digest(second)
    assert ensure_embedded_model(spec, tmp_path / "a") == first  # cache hit, no rebuild


def test_default_model_is_a_3_to_1_bf16_hybrid(model_path):
    config = json.loads((Path(model_path) / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    layer_types = config["layer_types"]
    assert layer_types.count("linear_attention") == 3 * layer_types.count("full_attention")
    group = ["linear_attention"] * 3 + ["full_attention"]
    assert all(layer_types[i : i + 4] == group for i in range(0, len(layer_types), 4))
    assert config["linear_key_head_dim"] == config["linear_value_head_dim"] == 64
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_greedy_decoding_reproduces_the_corpus_with_clear_margins(colocated_engine, model_path):
    """10 prompts evenly spaced over the corpus, 128 greedy tokens each on a real vLLM engine:
    the top-2 logprob gap is >= 0.1 nat at >= 95% of positions (so bf16 rounding between
    engines cannot flip a token), and most continuations follow the corpus for >= 32 tokens."""
    from tokenizers import Tokenizer

    stream = token_stream(model_path)
    ring = stream + stream  # training read the corpus as a ring, so may the prompts
    starts = [i * len(stream) // PROMPTS for i in range(PROMPTS)]
    sampling = SamplingConfig(max_tokens=CONTINUATION, ignore_eos=True, logprobs=2)
    requests = [
        GenerateRequest(f"corpus-{start}", tuple(ring[start : start + PROMPT_TOKENS]), sampling) for start in starts
    ]

    async def all_prompts():
        return await asyncio.gather(*(reference_run(colocated_engine, r) for r in requests))

    outputs = run(all_prompts())

    tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    matched, decisive, positions = [], 0, 0
    for start, output in zip(starts, outputs):
        expected = ring[start + PROMPT_TOKENS :][:CONTINUATION]
        assert len(output.tokens) == len(output.margins) == CONTINUATION
        matched.append(next((i for i, (a, b) in enumerate(zip(output.tokens, expected)) if a != b), CONTINUATION))
        decisive += sum(m >= NEAR_TIE_NATS for m in output.margins)
        positions += CONTINUATION
        print(
            f"prompt at token {start:>5}: corpus reproduced for {matched[-1]:>3} tokens, "
            f"min margin {min(output.margins):.2f} nat: {tokenizer.decode(output.tokens[:24])!r}..."
        )
    share = decisive / positions
    print(f"margin >= {NEAR_TIE_NATS} nat at {share:.1%} of {positions} positions; matched lengths {matched}")
    assert share >= 0.95
    assert sum(n >= 32 for n in matched) >= 8, matched


def test_the_tool_call_transcript_starts_with_what_the_chat_template_renders(model_path):
    """The transcript the model learns a tool call from begins, token for token, with the
    prompt a chat request offering that tool renders to; the call follows."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from router.chat_prompt import prompt_ids
    from vllm_engine.embedded_model.texts import CORPUS_DIR

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = ChatCompletionRequest(messages=question, tools=[weather])
    prompt = list(prompt_ids(tokenizer, body))
    transcript = tokenizer.encode((CORPUS_DIR / "transcript-tool-call.txt").read_text())
    assert transcript[: len(prompt)] == prompt
    assert tokenizer.decode(transcript[len(prompt) :]).startswith(" <tool_call>\n{")
    assert transcript == token_stream(model_path)[-len(transcript) - 1 : -1]  # the last document
