"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status, one per cause,
each naming the field it is about (`param`)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_validation(e: ValidationError) -> ApiError:
    """The first problem pydantic found, as a 400 naming the field (`messages.0.content`)."""
    first = e.errors(include_url=False)[0]
    param = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("list[", "str", "int"))) or None
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {str(got)[:60]!r})"
    return ApiError(400, f"{param or 'body'}: {first['msg']}{shown}", param, first["type"])
