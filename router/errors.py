"""OpenAI-style errors: one exception type the router raises, and its two wire forms.

Clients (the OpenAI SDK above all) only understand `{"error": {...}}` bodies with a
fitting status, and inside a stream only a `data: {"error": {...}}` event, which the
SDK raises as APIError. The shape matches vLLM's own ErrorResponse, so errors the
router makes and errors a worker makes look the same to a client.
"""

from __future__ import annotations

from http import HTTPStatus

import msgspec
from starlette.responses import Response

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class RouterError(Exception):
    """An error to hand to the client as it is: status, OpenAI type, message, optional param."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_json(self.status, self.message, self.param)

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, headers=self.headers, media_type="application/json")

    def sse_event(self) -> bytes:
        """The in-stream form: once a 200 stream has started, this is the only way to fail it."""
        return b"data: " + self.body() + b"\n\n"


def error_json(status: int, message: str, param: str | None = None) -> bytes:
    err_type = _TYPES.get(status) or (HTTPStatus(status).phrase.replace(" ", "") + "Error")
    return msgspec.json.encode({"error": {"message": message, "type": err_type, "param": param, "code": status}})


def overloaded(retry_after_s: int, what: str) -> RouterError:
    return RouterError(429, f"{what}; retry later", headers={"Retry-After": str(retry_after_s)})


def no_worker(role: str, model: str | None) -> RouterError:
    suffix = f" serving model {model!r}" if model else ""
    return RouterError(503, f"no healthy {role} worker{suffix}", headers={"Retry-After": "1"})
