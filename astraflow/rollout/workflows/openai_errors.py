"""The errors the OpenAI-compatible facade answers with: an HTTP status and an OpenAI-style error body."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered with ``status`` and an OpenAI-style body (``{"error": {message, type, param, code}}``)."""

    status = 500
    error_type = "server_error"

    def __init__(self, message: str, param: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.param = param
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.error_type, "param": self.param, "code": None, **self.extra}}


class BadRequest(ApiError):
    """A request the facade will not serve as asked (names the parameter)."""

    status, error_type = 400, "invalid_request_error"


class Unauthorized(ApiError):
    status, error_type = 401, "authentication_error"


class NotFound(ApiError):
    status, error_type = 404, "not_found"


class StaleNode(ApiError):
    """The node holds weights older than the task allows: give the task back (nak) and let a newer node take it."""

    status, error_type = 409, "stale_weights"


class Unavailable(ApiError):
    """The node cannot serve now (draining, not joined, the plane refused a publish): try again or give the task back."""

    status, error_type = 503, "unavailable"
