"""Every field of vLLM's OpenAI request models, placed: honoured end to end through
prefill/decode, or refused by name. The single source: the HTTP front refuses with it, docs/api.md
is rendered from it (`python -m router.openai_fields`), and a test fails when vLLM's models gain a
field it does not place.

Honoured means the answer is what a colocated vLLM engine gives for the field (a real-engine test
shows it per sampling field: tests/test_openai_http.py with tests/openai_cases.py), on the first
token that prefill samples and on decode's continuation alike. Refused means a request that sets
the field to anything but a value that asks for nothing (its default, or a no-op such as
`frequency_penalty: 0`) gets 400 naming it: never accepted and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from messages.errors import InvalidRequestError

COMPLETIONS, CHAT, RESPONSES = "completions", "chat", "responses"
BOTH = (COMPLETIONS, CHAT)


@dataclass(frozen=True, slots=True)
class Placement:
    name: str
    honoured: bool
    why: str
    endpoints: tuple[str, ...] = BOTH
    # Values besides the model's default that ask for nothing: accepted where the field is refused.
    neutral: tuple[Any, ...] = ()
    # For structured values (a pydantic model) that ask for nothing.
    is_neutral: Callable[[Any], bool] | None = None

    def asks_for_nothing(self, value: Any, default: Any) -> bool:
        if self.is_neutral is not None and self.is_neutral(value):
            return True
        return _same(value, default) or any(_same(value, v) for v in self.neutral)


def _same(a: Any, b: Any) -> bool:
    # bool is an int: `True` must not pass for a neutral `1`.
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _honoured(name: str, why: str, endpoints: tuple[str, ...] = BOTH) -> Placement:
    return Placement(name, True, why, endpoints)


def _refused(name: str, why: str, *neutral: Any, endpoints: tuple[str, ...] = BOTH, is_neutral=None) -> Placement:
    return Placement(name, False, why, endpoints, neutral, is_neutral)


_NOT_RENDER = "used by vLLM's /render endpoints only; pdserve has none"

TABLE: tuple[Placement, ...] = (
    # --- what to generate from ---------------------------------------------------------------
    _honoured("model", "checked: the served model's name (or left out); any other is 404 model_not_found"),
    _honoured("prompt", "one text or one list of token ids (a batch of one is unwrapped)", (COMPLETIONS,)),
    _honoured("messages", "rendered with the model's chat template; text content parts joined as vLLM does", (CHAT,)),
    _honoured("add_special_tokens", "passed to the router's tokenizer, which makes the prompt ids"),
    _honoured("add_generation_prompt", "passed to the chat template", (CHAT,)),
    _honoured(
        "continue_final_message",
        "passed to the chat template (vLLM refuses it together with add_generation_prompt)",
        (CHAT,),
    ),
    _honoured(
        "echo",
        "completions: the prompt's text (and with logprobs, its tokens' logprobs) before the output; max_tokens 0 "
        "returns the prompt alone; chat: the last message's content where its author answers (as vLLM)",
    ),
    _refused(
        "suffix",
        "fill-in-the-middle needs a model that renders it (vLLM refuses it too)",
        None,
        "",
        endpoints=(COMPLETIONS,),
    ),
    _refused(
        "prompt_embeds", "pdserve sends token ids to its engines, not embeddings", None, [], endpoints=(COMPLETIONS,)
    ),
    _refused("truncate_prompt_tokens", "not implemented: a prompt that does not fit is refused, never cut", None),
    _refused("truncation_side", "only with truncate_prompt_tokens, which is refused", None),
    _refused(
        "documents", "not implemented: RAG documents are not passed to the chat template", None, endpoints=(CHAT,)
    ),
    _refused(
        "chat_template",
        "a template from the request is code from the client (vLLM refuses it unless trusted)",
        None,
        endpoints=(CHAT,),
    ),
    _honoured(
        "chat_template_kwargs",
        "passed to the chat template and the parsers, filtered to what the template reads (as vLLM does)",
        (CHAT,),
    ),
    _refused("media_io_kwargs", "the served models take text only", None, {}, endpoints=(CHAT,)),
    _refused("mm_processor_kwargs", "the served models take text only", None, {}, endpoints=(CHAT,)),
    # --- how long -------------------------------------------------------------------------------
    _honoured("max_tokens", "the output's length cap; completions default 16, chat the context's end (as vLLM)"),
    _honoured("max_completion_tokens", "as max_tokens (it wins where both are set)", (CHAT,)),
    _honoured("stop", "stop strings: decode computes the whole output, so a string across the first token is seen"),
    _honoured("stop_token_ids", "checked by each engine on every token it samples"),
    _honoured("ignore_eos", "applies on both legs"),
    _honoured("min_tokens", "prefill's first token counts: decode is asked for min_tokens - 1"),
    _honoured("include_stop_str_in_output", "with stop strings, which decode checks over the whole output"),
    # --- sampling ---------------------------------------------------------------------------
    _honoured("temperature", "applies on both legs; default 1 (OpenAI's)"),
    _honoured("top_p", "applies on both legs"),
    _honoured("top_k", "applies on both legs (0 or -1: off)"),
    _honoured(
        "seed",
        "decode samples every token of a seeded request, so it draws what a colocated engine draws "
        "(the first token waits for the transfer)",
    ),
    _honoured("min_p", "per token, on both legs"),
    _honoured("logit_bias", "per token, on both legs; biases clamped to [-100, 100] as vLLM does"),
    _honoured("allowed_token_ids", "per token, on both legs"),
    _honoured("bad_words", "decode samples every token (a word of several tokens looks back across the first)"),
    _honoured("presence_penalty", "decode samples every token (vLLM counts output tokens only, the first among them)"),
    _honoured("frequency_penalty", "decode samples every token (vLLM counts output tokens only, the first among them)"),
    _honoured(
        "repetition_penalty",
        "on both legs: it counts prompt and output tokens alike, so decode's prompt holds the first",
    ),
    _honoured(
        "n",
        "1 to 16 choices; choice i samples with seed + i (as vLLM); choices after the first start once its prompt "
        "is in the prefill engine's prefix cache, so they compute and move only what the cache cannot hold",
    ),
    _refused("use_beam_search", "beam search does not run through P/D", False),
    _refused("length_penalty", "beam search only, which is refused", 1, 1.0),
    _refused("watermarking", "not implemented", None, False),
    _refused("logprob_token_ids", "not implemented: logprobs of chosen ids", None, []),
    _refused("repetition_detection", "not implemented", None),
    _refused("thinking_token_budget", "not implemented: reasoning is not cut short", None, -1),
    _honoured(
        "response_format",
        "json_object and json_schema (structural tags too) on vLLM's own backend; decode samples every token under "
        "the grammar, so it starts where a colocated engine's does (the first token waits for the transfer)",
    ),
    _honoured(
        "structured_outputs",
        "json, regex, choice, grammar, json_object, structural_tag: as response_format (both: one kind, or 400)",
    ),
    _honoured(
        "tools",
        "rendered by the chat template; calls parsed from the output by vLLM's parser (--tool-call-parser)",
        (CHAT,),
    ),
    _honoured(
        "tool_choice",
        "none; auto (--enable-auto-tool-choice); required and named as vLLM makes them: a structured output "
        "that decode samples whole, then parsed into tool_calls",
        (CHAT,),
    ),
    _honoured("parallel_tool_calls", "false keeps the first call, as vLLM does", (CHAT,)),
    _honoured("reasoning_effort", "passed to the chat template as enable_thinking (as vLLM)", (CHAT,)),
    _honoured(
        "include_reasoning", "false leaves out the reasoning vLLM's parser (--reasoning-parser) splits off", (CHAT,)
    ),
    # --- what comes back -------------------------------------------------------------------------
    _honoured("stream", "server-sent events, a chunk per engine step"),
    _honoured("stream_options", "include_usage, and vLLM's continuous_usage_stats (usage in every chunk)"),
    _honoured("logprobs", "every token's, the first from prefill, in vLLM's formatting; 0 to 20 alternatives"),
    _honoured("top_logprobs", "as logprobs: 0 to 20 alternatives", (CHAT,)),
    _honoured(
        "prompt_logprobs",
        "computed by the engine that computes the whole prompt: prefill, or where decode samples every token "
        "(seed, stop strings, penalties, structured outputs), the decode engine, prefilling it itself",
    ),
    _honoured("return_tokens_as_token_ids", "logprobs' tokens as 'token_id:<id>'"),
    _refused("return_token_ids", "not implemented", None, False),
    _refused("return_prompt_text", "not implemented", None, False, endpoints=(CHAT,)),
    _honoured("skip_special_tokens", "both legs' engines detokenize with it"),
    _honoured("spaces_between_special_tokens", "both legs' engines detokenize with it"),
    _refused("stream_interval", "a chunk per engine step", None, 1),
    _refused("routed_experts_prompt_start", "no mixture-of-experts routing data is returned", 0),
    _refused("return_token_offsets", _NOT_RENDER, False, None),
    _refused("mm_payload", _NOT_RENDER, "tensors"),
    _refused("return_mm_kwargs", _NOT_RENDER, None),
    # --- serving ------------------------------------------------------------------------------------
    _honoured("user", "an end user's id for the operator; it changes no output (at OpenAI and vLLM neither)"),
    _honoured("request_id", "the response's id (cmpl-<request_id>); engines run each leg under an id of their own"),
    _refused("session_id", "pdserve routes by engine load, not by session", None),
    _refused("priority", "engines schedule first come, first served", 0),
    _honoured("cache_salt", "both legs' engines key the prefix cache by it: different salts share no blocks"),
    _refused("kv_transfer_params", "the router owns every KV transfer", None, {}),
    _refused("ec_transfer_params", "no encoder cache transfer", None, {}),
    _refused("vllm_xargs", "no custom extensions", None, {}),
)

# The gRPC API's own request (proto/pdserve/v1/generate.proto): pdserve's fields, all honoured.
GRPC_TABLE: tuple[Placement, ...] = tuple(
    Placement(name, True, why, ("grpc",))
    for name, why in (
        ("request_id", "shown back in the final message and logs; engines run each leg under an id of their own"),
        ("text", "the prompt as text, tokenized by the router"),
        ("token_ids", "the prompt as token ids, sent to the engines as they are"),
        ("sampling.max_tokens", "the output's length cap; unset: 64"),
        ("sampling.temperature", "unset: 0 (greedy)"),
        ("sampling.top_p", "applies on both legs"),
        ("sampling.top_k", "applies on both legs"),
        ("sampling.seed", "decode samples every token of a seeded request: what a colocated engine draws"),
        ("sampling.stop", "decode computes the whole output, so a string across the first token is seen"),
        ("sampling.stop_token_ids", "checked by each engine on every token it samples"),
        ("sampling.ignore_eos", "applies on both legs"),
        ("sampling.logprobs", "top alternatives per token, the first token's from prefill"),
        ("cache_salt", "both legs' engines key the prefix cache by it: different salts share no blocks"),
    )
)

_BY_ENDPOINT: dict[str, dict[str, Placement]] = {
    endpoint: {p.name: p for p in TABLE if endpoint in p.endpoints} for endpoint in BOTH
}

# The Responses API (vLLM's ResponsesRequest): text in and out, through the same request path
# as chat. These fields mean there what they mean in chat.
_SHARED_WITH_CHAT = (
    "model", "stream", "temperature", "top_p", "top_k", "min_p", "seed", "logit_bias", "stop", "stop_token_ids",
    "ignore_eos", "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "skip_special_tokens", "structured_outputs", "chat_template_kwargs", "include_reasoning", "user", "cache_salt",
    "watermarking", "session_id", "priority", "media_io_kwargs", "mm_processor_kwargs", "mm_payload",
    "return_mm_kwargs", "vllm_xargs", "kv_transfer_params", "ec_transfer_params",
)  # fmt: skip
_ONLY_RESPONSES = (RESPONSES,)
RESPONSES_TABLE: tuple[Placement, ...] = tuple(
    replace(_BY_ENDPOINT[CHAT][name], endpoints=_ONLY_RESPONSES) for name in _SHARED_WITH_CHAT
) + tuple(
    replace(p, endpoints=_ONLY_RESPONSES)
    for p in (
        _honoured("input", "text, or input items of text (rendered with instructions by the chat template)"),
        _honoured("instructions", "the system message before the input"),
        _honoured("max_output_tokens", "the output's length cap (unset: the context's end)"),
        _honoured("text", "format text, json_object or json_schema: a structured output, as response_format"),
        _honoured("top_logprobs", "0 to 20 alternatives per output token, with include message.output_text.logprobs"),
        _honoured("include", "message.output_text.logprobs; any other item is refused by name"),
        _honoured("metadata", "returned with the response as given"),
        _honoured("request_id", "the response's id; engines run each leg under an id of their own"),
        _refused("store", "pdserve keeps no responses (no retrieval, previous_response_id): send false", None, False),
        _refused("background", "responses run in the foreground only", None, False),
        _refused("previous_response_id", "pdserve keeps no responses: send the whole conversation as input", None),
        _refused("previous_input_messages", "pdserve keeps no responses: send the whole conversation as input", None),
        _refused("enable_response_messages", "not implemented", None, False),
        _refused("prompt", "stored prompt templates are OpenAI's: send the input itself", None),
        _refused("reasoning", "not implemented: pass enable_thinking in chat_template_kwargs", None),
        _refused("prompt_cache_key", "pdserve routes by the prompt's own prefix-cache blocks", None),
        _refused("service_tier", "one service tier", "auto", "default"),
        _refused("truncation", "a prompt that does not fit is refused, never cut", None, "disabled"),
        _refused("tools", "tool calling through /v1/responses is not implemented: use /v1/chat/completions", None, []),
        _refused("tool_choice", "no tools through /v1/responses: only auto or none (no tools)", None, "auto", "none"),
        _refused("parallel_tool_calls", "no tools through /v1/responses", None, True),
        _refused("max_tool_calls", "no tools through /v1/responses", None),
    )
)
_BY_ENDPOINT[RESPONSES] = {p.name: p for p in RESPONSES_TABLE}


def placements(endpoint: str) -> dict[str, Placement]:
    return _BY_ENDPOINT[endpoint]


def refuse_what_is_not_honoured(body: Any, endpoint: str) -> None:
    """Raise InvalidRequestError naming the first field `body` (a vLLM request model) sets to
    something pdserve does not do, or a field no model has."""
    table = _BY_ENDPOINT[endpoint]
    for name in sorted(body.model_fields_set):
        placement = table.get(name)
        if placement is None:
            if name in type(body).model_fields:  # a new vLLM field: tests/test_openai_fields.py says so
                raise InvalidRequestError(name, "pdserve does not place this field yet: leave it out")
            raise InvalidRequestError(
                name, "unrecognized request argument (OpenAI's and vLLM's fields only): leave it out"
            )
        if placement.honoured:
            continue
        field = type(body).model_fields[name]
        default = field.get_default(call_default_factory=True)
        if not placement.asks_for_nothing(getattr(body, name), default):
            raise InvalidRequestError(name, f"not supported through pdserve ({placement.why}): leave it out")


def markdown(rows: Iterable[Placement] = TABLE) -> str:
    """A table as docs/api.md shows it: honoured rows first."""
    lines = ["| field | endpoints | | why |", "|---|---|---|---|"]
    for p in sorted(rows, key=lambda p: (not p.honoured, p.name)):
        where = "both" if p.endpoints == BOTH else ", ".join(p.endpoints)
        lines.append(f"| `{p.name}` | {where} | {'honoured' if p.honoured else 'refused'} | {p.why} |")
    return "\n".join(lines) + "\n"


# docs/api.md holds the tables between these lines; `python -m router.openai_fields` rewrites them.
BEGIN, END = "<!-- request-fields: begin (python -m router.openai_fields) -->", "<!-- request-fields: end -->"


def rendered_section() -> str:
    return (
        f"{BEGIN}\n### HTTP (`/v1/completions`, `/v1/chat/completions`)\n\n{markdown(TABLE)}\n"
        f"### HTTP (`/v1/responses`)\n\n{markdown(RESPONSES_TABLE)}\n"
        f"### gRPC (`pdserve.v1.Generation/Generate`)\n\n{markdown(GRPC_TABLE)}{END}"
    )


def with_section(doc: str) -> str:
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + rendered_section() + tail


if __name__ == "__main__":  # pragma: no cover
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "docs" / "api.md"
    path.write_text(with_section(path.read_text()))
    print(f"wrote the request-field tables into {path}")
