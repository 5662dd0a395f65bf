"""Chat messages to prompt token ids, with the model's own chat template, as vLLM renders them
for a text-only model.

vLLM's renderer (vllm.renderers.chat_utils.parse_chat_messages) needs an engine's ModelConfig
for its multimodal tracking, which a router does not build; this module runs the parts of it a
text model uses: vLLM's own content-part parser, its template content-format detection, and its
joining of text parts ("\\n"). A part that is not text (an image, audio) is refused by name:
rendered as-is, the template would print the Python dict into the prompt and answer 200.
"""

from __future__ import annotations

import functools
from typing import Any

from messages.errors import InvalidRequestError


@functools.cache
def content_format(chat_template: str) -> str:
    """'string' (content is text) or 'openai' (the template loops over content parts)."""
    from vllm.renderers.hf import _detect_content_format

    return _detect_content_format(chat_template, default="string")


def conversation(messages: list[Any], chat_template: str) -> list[dict[str, Any]]:
    """The messages with their content as the template expects it."""
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.chat_utils import TEXT_PART_TYPES, _parse_chat_message_content_mm_part

    as_parts = content_format(chat_template) == "openai"
    rendered = []
    for i, message in enumerate(messages):
        message = dict(message)
        content = message.get("content")
        if content is None or isinstance(content, str):
            texts = [] if content is None else [content]
        else:
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    texts.append(part)
                    continue
                try:
                    kind, text = _parse_chat_message_content_mm_part(part)
                except VLLMValidationError as err:
                    raise InvalidRequestError(f"messages[{i}].content[{j}]", err.args[0]) from None
                if kind not in TEXT_PART_TYPES:
                    raise InvalidRequestError(
                        f"messages[{i}].content[{j}]", f"a {kind!r} part: the served model takes text only"
                    )
                if text is not None:
                    texts.append(text)
        message["content"] = [{"type": "text", "text": t} for t in texts] if as_parts else "\n".join(texts)
        rendered.append(message)
    return rendered


def prompt_ids(tokenizer: Any, body: Any) -> tuple[int, ...]:
    """`body` (vLLM's ChatCompletionRequest) rendered and tokenized."""
    from jinja2 import TemplateError

    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError("messages", "this model has no chat template: use /v1/completions")
    if not body.messages:
        raise InvalidRequestError("messages", "give at least one message")
    try:
        text = tokenizer.apply_chat_template(
            conversation(body.messages, template),
            tools=[tool.model_dump() for tool in body.tools] if body.tools else None,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tokenize=False,
            **template_kwargs(tokenizer, template, body),
        )
    except TemplateError as err:  # the model's template refuses them (a role it does not know, ...)
        raise InvalidRequestError("messages", f"the model's chat template refused them: {err}") from None
    return tuple(tokenizer.encode(text, add_special_tokens=body.add_special_tokens))


def template_kwargs(tokenizer: Any, template: str, body: Any) -> dict[str, Any]:
    """The request's chat_template_kwargs as vLLM passes them: reasoning_effort as
    enable_thinking unless given, then only the names the template or Hugging Face reads."""
    from vllm.renderers.hf import resolve_chat_template_kwargs

    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = body.reasoning_effort != "none"
    try:
        return resolve_chat_template_kwargs(tokenizer, template, kwargs)
    except ValueError as err:  # chat_template or tokenize among them
        raise InvalidRequestError("chat_template_kwargs", str(err)) from None
