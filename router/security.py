"""Who may call what: server TLS (optionally mutual), bearer tokens with roles, and the
matching client-side credentials for `pdserve generate`, the load generator and tests.

Tokens come from a file (`--tokens-file`) or the environment (`PDSERVE_TOKENS`), never from
a command line (visible to every user of the host in `ps`). One token per entry,
`ROLE:TOKEN` (a file may put one per line, `#` starts a comment). Roles: `generate` may call
the Generation service; `admin` may call everything, Admin included. The standard health
service stays open (load balancers probe it without credentials); reflection needs a token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc

from configuration.fields import knob

TOKENS_ENV = "PDSERVE_TOKENS"  # server: "admin:SECRET,generate:SECRET2"
CLIENT_TOKEN_ENV = "PDSERVE_TOKEN"  # clients: the bearer token they send
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_ADMIN_PREFIX = "/pdserve.v1.Admin/"


class TokenRole(str, Enum):
    GENERATE = "generate"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class TokenTable:
    """SHA-256 of each token -> its role (the plain tokens are not kept)."""

    digests: dict[bytes, TokenRole]

    @classmethod
    def parse(cls, text: str, source: str) -> "TokenTable":
        digests: dict[bytes, TokenRole] = {}
        entries = [e.strip() for line in text.splitlines() for e in line.split("#", 1)[0].split(",")]
        for entry in filter(None, entries):
            role, sep, token = entry.partition(":")
            if not sep or not token or role not in TokenRole._value2member_map_:
                raise ValueError(f"{source}: entries are ROLE:TOKEN with ROLE generate or admin, got {entry[:12]!r}...")
            if len(token) < 16:
                raise ValueError(f"{source}: a {role} token has {len(token)} characters; use at least 16")
            digests[_digest(token)] = TokenRole(role)
        if not digests:
            raise ValueError(f"{source}: no tokens")
        return cls(digests)

    @classmethod
    def load(cls, path: str | None) -> "TokenTable | None":
        """From `path`, else from PDSERVE_TOKENS, else None (authentication off)."""
        if path:
            return cls.parse(Path(path).read_text(), path)
        if os.environ.get(TOKENS_ENV):
            return cls.parse(os.environ[TOKENS_ENV], TOKENS_ENV)
        return None

    def role_of(self, token: str) -> TokenRole | None:
        digest = _digest(token)
        # Constant-time comparison against every entry: no timing hint of a near match.
        found = None
        for known, role in self.digests.items():
            if hmac.compare_digest(known, digest):
                found = role
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without a known bearer token; PERMISSION_DENIED for a generate token
    on Admin."""

    def __init__(self, tokens: TokenTable) -> None:
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method
        handler = await continuation(details)
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        role = self._tokens.role_of(token) if scheme.lower() == "bearer" and token else None
        if role is None:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, "send 'authorization: Bearer <token>' metadata")
        if method.startswith(_ADMIN_PREFIX) and role is not TokenRole.ADMIN:
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, f"{method} needs an admin token")
        return handler


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same call shape as `handler` that only ends the call with `code`."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover (makes this an async generator)

    serialization = dict(
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **serialization)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **serialization)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **serialization)
    return grpc.stream_stream_rpc_method_handler(streaming, **serialization)


@dataclass(frozen=True, slots=True)
class ServerTLS:
    cert: str = knob(help="PEM certificate chain: serve TLS (with --tls-key)")
    key: str = knob(help="PEM private key of --tls-cert")
    client_ca: str | None = knob(None, help="PEM roots: require client certificates signed by them (mutual TLS)")

    def credentials(self) -> grpc.ServerCredentials:
        client_ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    """What a client presents: the server's CA (TLS), its own cert (mutual TLS), a token."""

    ca: str | None = knob(None, flag="tls-ca", help="PEM roots to verify the server with (turns TLS on)")
    cert: str | None = knob(None, flag="tls-cert", help="client certificate, for servers that require mutual TLS")
    key: str | None = knob(None, flag="tls-key", help="private key of --tls-cert")
    token: str | None = knob(
        None,
        flag="token-file",
        parse=lambda path: Path(path).read_text().strip(),
        absent=lambda: os.environ.get(CLIENT_TOKEN_ENV) or None,
        help=f"file holding the bearer token (unset: ${CLIENT_TOKEN_ENV})",
    )

    @classmethod
    def from_env(
        cls, ca: str | None = None, cert: str | None = None, key: str | None = None, token_file: str | None = None
    ) -> "ClientCredentials":
        token = Path(token_file).read_text().strip() if token_file else os.environ.get(CLIENT_TOKEN_ENV) or None
        return cls(ca, cert, key, token)

    def channel(self, target: str) -> grpc.aio.Channel:
        if self.ca is None:
            return grpc.aio.insecure_channel(target)
        tls = grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes(),
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None,
        )
        return grpc.aio.secure_channel(target, tls)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()
