"""The OpenAI-compatible HTTP front: `POST /v1/completions`, `POST /v1/chat/completions`,
`GET /v1/models`, `GET /health`, on the same orchestrator, admission, tokens and metrics as
the gRPC front, so the OpenAI SDK and the field's benchmark tools (`vllm bench serve`,
guidellm, aiperf) can drive pdserve.

Request and response bodies are vLLM's own OpenAI protocol models (pydantic); the ASGI stack
is FastAPI + uvicorn, which vLLM already installs. Every field is honoured or refused by name
(router/openai_fields.py), and validated where the gRPC front validates (messages/requests.py).
Streams are server-sent events with `stream_options.include_usage`; errors, on every route,
are OpenAI's error JSON (docs/api.md). A client that disconnects, streamed or not, aborts the
request on whichever engine holds it. pdserve's phase timings ride along as an extension
field, `pdserve_timings`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from messages.errors import UNAVAILABLE, DrainingError, InvalidRequestError, OverloadedError
from messages.requests import STRUCTURED_KINDS, GenerateRequest, SamplingConfig, StructuredOutput
from router import chat_prompt
from router.admission import AdmissionController
from router.binding import bind_error
from router.chat_parsing import ChatParsers, ChatParsing
from router.metrics import REQUESTS
from router.openai_errors import HTTPError, invalid
from router.openai_fields import CHAT, COMPLETIONS, RESPONSES, refuse_what_is_not_honoured
from router.responses_api import ResponsesShape, as_chat_request
from router.openai_responses import ChatShape, CompletionShape, Echo, Event, ResponseShape, chat_role, collect
from router.security import TokenRole, TokenTable

if TYPE_CHECKING:
    from router.orchestrator import Orchestrator

log = logging.getLogger(__name__)

# OpenAI's default where it differs from pdserve's gRPC one (max_tokens: vLLM's models hold
# OpenAI's, 16 for completions, the context's end for chat).
DEFAULT_TEMPERATURE = 1.0
# Choices per request (n): each is a sequence on a decode engine, admitted as one request.
MAX_CHOICES = 16


class OpenAIFront:
    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenizer: Any,  # a Hugging Face tokenizer (its chat template for chat completions)
        model_name: str,
        admission: AdmissionController,
        max_prompt_bytes: int,
        tokens: TokenTable | None = None,
        parsers: ChatParsers = ChatParsers(),
    ) -> None:
        """`parsers`: vLLM's tool-call and reasoning parsers for chat answers (checked here,
        against the tokenizer: a name vLLM does not know fails the router's start)."""
        self._orchestrator = orchestrator
        self._parsers = parsers
        self._parser_class = parsers.parser_class(tokenizer)
        self._reasoning_parser_class = parsers.parser_class(tokenizer, tools=False)
        self._tokenizer = tokenizer
        self.model_name = model_name
        self._admission = admission
        self._max_prompt_bytes = max_prompt_bytes
        self._tokens = tokens
        self.app = self._build_app()

    # --- routes --------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(HTTPError)
        async def http_error(request: Request, err: HTTPError) -> JSONResponse:  # noqa: ARG001
            REQUESTS.labels(_OUTCOMES.get(err.status, "internal")).inc()
            return err.response()

        @app.exception_handler(InvalidRequestError)
        async def invalid_request(request: Request, err: InvalidRequestError) -> JSONResponse:  # noqa: ARG001
            REQUESTS.labels("invalid_argument").inc()
            return invalid(str(err), err.field).response()

        @app.exception_handler(StarletteHTTPException)
        async def route_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
            # Unknown routes and methods in OpenAI's shape too, not FastAPI's {"detail": ...}.
            where = f"{request.method} {request.url.path}"
            if err.status_code == 404:
                message = f"no route {where}: this server has {', '.join(_ROUTES)}"
            elif err.status_code == 405:
                message = f"{request.url.path} does not take {request.method}"
            else:  # pragma: no cover (the app raises no other)
                message = str(err.detail)
            return HTTPError(err.status_code, message, "invalid_request_error", headers=err.headers).response()

        @app.exception_handler(Exception)
        async def unexpected(request: Request, err: Exception) -> JSONResponse:
            log.error("%s %s failed", request.method, request.url.path, exc_info=err)
            REQUESTS.labels("internal").inc()
            return HTTPError(500, "internal error; the router's log has details", "server_error").response()

        @app.get("/health")
        async def health() -> JSONResponse:
            serving = self._orchestrator.decode.has_live_member and not self._admission.draining
            return JSONResponse({"status": "ok" if serving else "unavailable"}, status_code=200 if serving else 503)

        @app.get("/v1/models")
        async def models(request: Request) -> Any:
            from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

            self._authorize(request)
            card = ModelCard(
                id=self.model_name, owned_by="pdserve", max_model_len=self._orchestrator.limits.max_model_len
            )
            return JSONResponse(ModelList(data=[card]).model_dump())

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest

            self._authorize(request)
            body = self._parse(CompletionRequest, COMPLETIONS, request, await request.body())
            prompt = await self._completion_prompt(body)
            echo = await self._completion_echo(body, prompt) if body.echo else None
            shape = CompletionShape(self.model_name, body, self._tokenizer, _choices(body), echo)
            return await self._respond(request, body, prompt, shape)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Any:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

            self._authorize(request)
            body = self._parse(ChatCompletionRequest, CHAT, request, await request.body())
            ChatParsing.check(body, self._parser_class, self._parsers)
            body = ChatParsing.adjusted(body, self._parser_class, self._tokenizer)
            prompt = await asyncio.to_thread(self._chat_prompt, body)
            parsing = ChatParsing(self._parser_class, body, self._tokenizer, list(prompt))
            echo = _chat_echo(body) if body.echo else None
            shape = ChatShape(self.model_name, body, self._tokenizer, _choices(body), echo, parsing)
            return await self._respond(request, body, prompt, shape)

        @app.post("/v1/responses")
        async def responses(request: Request) -> Any:
            from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

            self._authorize(request)
            body = self._parse(ResponsesRequest, RESPONSES, request, await request.body())
            chat = as_chat_request(body)
            try:
                prompt = await asyncio.to_thread(self._chat_prompt, chat)
            except (HTTPError, InvalidRequestError) as err:  # in this body's names: its messages are its input
                raise invalid(str(getattr(err, "message", err)).replace("messages", "input"), "input") from None
            shape = ResponsesShape(self.model_name, body, self._tokenizer, self._reasoning_parser_class)
            shape.set_prompt(prompt)
            return await self._respond(request, body, prompt, shape)

        return app

    # --- request -> GenerateRequest ------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self._tokens is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        role = self._tokens.role_of(token) if scheme.lower() == "bearer" and token else None
        if role is None:
            raise HTTPError(401, "send 'Authorization: Bearer <token>'", "authentication_error", code="invalid_api_key")
        if role not in (TokenRole.GENERATE, TokenRole.ADMIN):  # pragma: no cover (every role may generate today)
            raise HTTPError(403, "this token may not generate", "permission_error")

    def _parse(self, model: type, endpoint: str, request: Request, raw: bytes) -> Any:
        """The body as vLLM's request model; every way it can be malformed is a 400 naming
        the field (vLLM's own validators raise VLLMValidationError, which pydantic does not
        wrap: unhandled, it was a 500), and so is every field set to something pdserve does
        not do (router/openai_fields.py)."""
        from pydantic import ValidationError
        from vllm.exceptions import VLLMValidationError

        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise HTTPError(
                415, f"Content-Type {media or '(none)'}: send the body as JSON with 'Content-Type: application/json'",
                "invalid_request_error", code="unsupported_media_type",
            )  # fmt: skip
        if len(raw) > self._max_prompt_bytes + 65536:
            raise HTTPError(413, f"request body of {len(raw):,} bytes is too large", "invalid_request_error")
        try:
            body = model.model_validate_json(raw)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            loc = first["loc"]
            # pydantic's location names union members too ("list[constrained-int]"): keep fields
            where = "".join(
                f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc if isinstance(p, int) or p.isidentifier()
            )
            where = where.lstrip(".")
            raise invalid(f"{where or 'request body'}: {first['msg']}", str(loc[0]) if loc else None) from None
        except VLLMValidationError as err:
            raise invalid(f"{err.parameter or 'request body'}: {err.args[0]}", err.parameter) from None
        except (TypeError, AttributeError, KeyError) as err:  # a vLLM validator tripped on a value's type
            raise invalid(f"request body: a field has a value of the wrong type ({err})") from None
        if body.model and body.model != self.model_name:
            raise HTTPError(
                404, f"model {body.model!r} is not served here: use {self.model_name!r}", "invalid_request_error",
                "model", code="model_not_found",
            )  # fmt: skip
        refuse_what_is_not_honoured(body, endpoint)
        return body

    async def _completion_prompt(self, body: Any) -> tuple[int, ...]:
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if len(prompt.encode()) > self._max_prompt_bytes:
                raise invalid(f"prompt: at most {self._max_prompt_bytes:,} bytes", "prompt")
            return tuple(
                await asyncio.to_thread(self._tokenizer.encode, prompt, add_special_tokens=body.add_special_tokens)
            )
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return tuple(prompt)
        raise invalid("prompt: one string or one list of token ids per request", "prompt")

    async def _completion_echo(self, body: Any, prompt: tuple[int, ...]) -> Echo:
        """The prompt as vLLM echoes it: the text as sent, or token ids' text; with max_tokens
        0, alone (vLLM then runs one token it does not return)."""
        text = body.prompt[0] if isinstance(body.prompt, list) and len(body.prompt) == 1 else body.prompt
        if not isinstance(text, str):
            text = await asyncio.to_thread(self._tokenizer.decode, list(prompt))
        return Echo(text, prompt, only=body.max_tokens == 0)

    def _chat_prompt(self, body: Any) -> tuple[int, ...]:
        size = len(json.dumps(body.messages, default=str).encode())
        if size > self._max_prompt_bytes:
            raise invalid(f"messages: at most {self._max_prompt_bytes:,} bytes", "messages")
        try:
            return chat_prompt.prompt_ids(self._tokenizer, body)
        except ValueError as err:  # Hugging Face's checks (continue_final_message without a final message)
            if isinstance(err, InvalidRequestError):
                raise
            raise invalid(f"messages: {err}", "messages") from None

    def _sampling(self, body: Any, shape: ResponseShape, prompt_tokens: int) -> SamplingConfig:
        """The body's sampling settings; the Responses API's model lacks a few of chat's."""
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        allowed = getattr(body, "allowed_token_ids", None)
        max_tokens = shape.max_tokens(body)
        if max_tokens is None:  # chat: up to the context's end, as vLLM and OpenAI do
            max_tokens = max(1, self._orchestrator.limits.max_model_len - prompt_tokens)
        if max_tokens == 0 and shape.echoes_only:
            max_tokens = 1  # as vLLM: one token is run, the prompt alone returned
        return SamplingConfig(
            max_tokens=max_tokens,
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0),
            seed=body.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
            logprobs=shape.logprobs(body),
            min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=_logit_bias(body.logit_bias),
            allowed_token_ids=None if allowed is None else tuple(allowed),
            bad_words=tuple(getattr(body, "bad_words", None) or ()),
            min_tokens=getattr(body, "min_tokens", 0),
            include_stop_str_in_output=body.include_stop_str_in_output,
            structured=_structured(body),
            prompt_logprobs=shape.prompt_logprobs_asked(body),
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=getattr(body, "spaces_between_special_tokens", True),
        )

    # --- response --------------------------------------------------------------------------

    async def _respond(self, http: Request, body: Any, prompt: tuple[int, ...], shape: ResponseShape) -> Any:
        request = GenerateRequest(
            f"http-{uuid.uuid4().hex[:16]}", prompt, self._sampling(body, shape, len(prompt)), body.cache_salt or ""
        )
        try:
            request.validate(self._orchestrator.limits)
        except InvalidRequestError as err:  # the one validation both fronts share, in this body's names
            param = shape.param(err.field, body)
            raise invalid(f"{param}: {err.message}", param) from None
        slot = self._admission.admitted()
        try:
            await slot.__aenter__()
        except OverloadedError as err:
            retry = {"Retry-After": str(max(1, round(err.retry_after_s)))}
            raise HTTPError(429, str(err), "rate_limit_error", headers=retry, code="rate_limit_exceeded") from None
        except DrainingError as err:
            raise HTTPError(503, str(err), "service_unavailable") from None
        shape.sampling = request.sampling
        requests = _choice_requests(request, shape.n)
        events = self._events(requests, slot)
        if body.stream:
            options = getattr(body, "stream_options", None)
            include_usage = bool(options and options.include_usage)
            # vLLM's extension: usage so far in every chunk too
            continuous = include_usage and bool(options.continuous_usage_stats)
            shape.template()
            first = await anext(events)  # a request failing before any token gets its HTTP status
            stream = shape.stream(first, events, include_usage, len(prompt) if continuous else None)
            return StreamingResponse(stream, media_type="text/event-stream")
        # Not streamed: nothing is written until the end, so watch the connection instead; a
        # client that leaves aborts the request on whichever engine holds it.
        whole = asyncio.ensure_future(collect(events, len(requests)))
        left = asyncio.ensure_future(_disconnected(http))
        await asyncio.wait((whole, left), return_when=asyncio.FIRST_COMPLETED)
        if not whole.done():
            whole.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await whole
            log.info("request %s: the client left; aborted", request.request_id)
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        left.cancel()
        outputs, results = whole.result()
        return JSONResponse(shape.whole(outputs, results))

    async def _events(
        self, requests: list[GenerateRequest], slot: contextlib.AbstractAsyncContextManager
    ) -> AsyncIterator[Event]:
        """The orchestrator's events of every choice; failures become HTTPError; the admission
        slot is held until the last choice ends (or the client leaves)."""
        try:
            async for event in _choices_in_turn([self._orchestrator.generate(r) for r in requests]):
                yield event
        except InvalidRequestError as err:  # an engine's own check (vLLM's SamplingParams)
            raise invalid(str(err), err.field) from None
        except tuple(UNAVAILABLE) as err:
            log.warning("request %s: %s", requests[0].request_id, err)
            message = next(text for kind, text in UNAVAILABLE.items() if isinstance(err, kind))
            raise HTTPError(503, message, "service_unavailable") from None
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            log.exception("request %s failed", requests[0].request_id)
            raise HTTPError(
                500, f"internal error serving {requests[0].request_id}; the router's log has details", "server_error"
            ) from None
        finally:
            await slot.__aexit__(None, None, None)


_OUTCOMES = {
    400: "invalid_argument",
    401: "unauthenticated",
    404: "not_found",
    413: "invalid_argument",
    415: "invalid_argument",
    429: "resource_exhausted",
    500: "internal",
    503: "unavailable",
}
_ROUTES = (
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "GET /v1/models",
    "GET /health",
)


def _chat_echo(body: Any) -> Echo | None:
    """vLLM's chat echo: the last message's content, where its author is the one answering."""
    last = body.messages[-1]
    if last.get("role") != chat_role(body) or not last.get("content"):
        return None
    content = last["content"]
    if not isinstance(content, str):
        content = "\n".join(part["text"] for part in content if isinstance(part, dict) and "text" in part)
    return Echo(content)


def _choices(body: Any) -> int:
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise invalid(f"n: must be in [1, {MAX_CHOICES}], got {n}", "n")
    return n


def _choice_requests(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The request's n choices as vLLM's parallel sampling makes them: choice i draws with seed
    + i; the prompt's logprobs come once, with choice 0."""
    sampling = request.sampling
    return [request] + [
        replace(
            request,
            request_id=f"{request.request_id}-{i}",
            sampling=replace(sampling, seed=None if sampling.seed is None else sampling.seed + i, prompt_logprobs=None),
        )
        for i in range(1, n)
    ]


async def _choices_in_turn(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Event]:
    """The choices' events as they come, tagged with the choice. Choice 0 runs first; the
    others start once its first event is in, when its prompt is in the prefill engine's prefix
    cache: they compute only what the cache cannot hold (docs/api.md, "n")."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    ended = object()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for event in stream:
                queue.put_nowait((index, event))
            queue.put_nowait((index, ended))
        except Exception as err:  # noqa: BLE001 (handed to the caller, which raises it)
            queue.put_nowait((index, err))

    tasks = [asyncio.create_task(pump(0, streams[0]))]
    running = len(streams)
    try:
        while running:
            index, event = await queue.get()
            if isinstance(event, Exception):
                raise event
            if len(tasks) == 1:
                tasks += [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams[1:], 1)]
            if event is ended:
                running -= 1
            else:
                yield index, event
    finally:  # a failed choice, or the client left: stop the others on their engines too
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(http: Request) -> None:
    """Returns when the client has closed its connection (the body is read by now, so the
    server's next message for this request is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as ids, each bias clamped to [-100, 100] as vLLM's
    SamplingParams.from_optional does (a colocated vLLM server clamps, never refuses)."""
    if not bias:
        return ()
    if any(math.isnan(value) for value in bias.values()):
        raise InvalidRequestError("logit_bias", "a bias is NaN: give numbers in [-100, 100]")
    try:
        return tuple((int(token), min(100.0, max(-100.0, value))) for token, value in bias.items())
    except ValueError:
        raise InvalidRequestError("logit_bias", 'keys must be token ids (as strings), e.g. {"50256": -100}') from None


def _structured(body: Any) -> StructuredOutput | None:
    """The body's constraint as vLLM reads it (response_format's kind set over structured_outputs':
    vLLM's own extract_structured_outputs), in our terms."""
    from vllm.exceptions import VLLMValidationError

    try:
        params = body.extract_structured_outputs()
    except VLLMValidationError as err:  # structured_outputs and response_format ask for two kinds
        raise InvalidRequestError("response_format", str(err)) from None
    if params is None:
        return None
    kind = next(k for k in STRUCTURED_KINDS if getattr(params, k) is not None)  # vLLM checked: exactly one
    spec = getattr(params, kind)
    if kind == "json_object":
        spec = ""
    elif kind == "choice":
        spec = tuple(str(choice) for choice in spec)
    elif not isinstance(spec, str):  # a JSON schema given as an object
        spec = json.dumps(spec)
    return StructuredOutput(
        kind, spec, params.disable_any_whitespace, params.disable_additional_properties, params.whitespace_pattern
    )


class HTTPServer:
    """uvicorn serving the app on the router's own event loop, beside the gRPC server."""

    def __init__(self, front: OpenAIFront, address: str, tls: Any = None, reuse_port: bool = False) -> None:
        """`reuse_port`: several routers on one host share the port (SO_REUSEPORT, as gRPC
        servers do by default); the kernel spreads connections over them."""
        import uvicorn

        host, _, port = address.rpartition(":")
        ssl = {}
        if tls is not None:
            import ssl as ssl_module

            ssl = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            if tls.client_ca:
                ssl |= {"ssl_ca_certs": tls.client_ca, "ssl_cert_reqs": ssl_module.CERT_REQUIRED}
        config = uvicorn.Config(front.app, host=host, port=int(port), log_level="warning", lifespan="off", **ssl)
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None
        self._host = host
        self._socket = _reusable_socket(host, int(port)) if reuse_port else None
        self.address = address

    async def start(self) -> None:
        sockets = [self._socket] if self._socket else None
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=sockets))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the start-up error (port taken, bad certificate)
            await asyncio.sleep(0.02)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.address = f"{self._host}:{port}"

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task


def _reusable_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as err:  # the bare error names no address
        sock.close()
        raise bind_error("HTTP front", host, port, err) from None
    return sock


def openai_front_for(
    router_server: Any, tokenizer: Any, model_name: str, parsers: ChatParsers = ChatParsers()
) -> OpenAIFront:
    """The HTTP front sharing a gRPC RouterServer's orchestrator, admission and tokens."""
    return OpenAIFront(
        router_server.orchestrator,
        tokenizer,
        model_name,
        router_server.admission,
        router_server.max_prompt_bytes,
        router_server.front.tokens,
        parsers,
    )
