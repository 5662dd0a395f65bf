"""Errors in OpenAI's shape, for every route of the HTTP front (docs/api.md, "Errors")."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class HTTPError(Exception):
    """An answer in OpenAI's error shape: `code` is a string or null (never the HTTP status,
    which the status line carries), `param` names the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        headers: dict | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", param)
