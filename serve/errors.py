"""The gateway's error contract: JSON `{"error": {"code", "message"}}` with the right HTTP status.

A failure inside the gateway (a bug, not the client's fault) is answered 500 with a generic message and a
request id (`internal_error`), never the exception's text: that may name paths, addresses or secrets. The
traceback goes to the gateway's log under the same id, where an operator finds it.
"""

from __future__ import annotations

import logging
import uuid

import orjson
from starlette.responses import Response

from lorafleet import wire


class ApiError(Exception):
    """An error answered to the client; `message` says what to fix."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers

    def response(self) -> Response:
        return error_response(self.status, self.code, self.message, self.headers)


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   request_id: str | None = None) -> Response:
    error: dict[str, str] = {"code": code, "message": message}
    if request_id is not None:
        error["request_id"] = request_id
        headers = {**(headers or {}), REQUEST_ID_HEADER: request_id}
    return Response(orjson.dumps({"error": error}), status_code=status, headers=headers,
                    media_type="application/json")


REQUEST_ID_HEADER = "X-Request-Id"


def internal_error(log: logging.Logger, what: str) -> Response:
    """The 500 for an unexpected exception (call it in an `except` block): the traceback is logged under a
    fresh request id, and the client gets only that id."""
    request_id = uuid.uuid4().hex
    log.exception("%s failed (request id %s)", what, request_id)
    return error_response(500, "internal_error",
                          f"the gateway failed; quote request id {request_id} to its operator",
                          request_id=request_id)


def clip(text: str, limit: int = 100) -> str:
    """A client-supplied string as it may appear in an error message: at most `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def bad_request(code: str, message: str) -> ApiError:
    return ApiError(400, code, message)


# Worker error codes (wire.ERR_*) → (HTTP status, public code).
WORKER_ERRORS: dict[str, tuple[int, str]] = {
    wire.ERR_DEADLINE: (504, "deadline_exceeded"),
    wire.ERR_ADAPTER: (503, "adapter_unavailable"),
    wire.ERR_MALFORMED: (500, "internal_error"),
    wire.ERR_RUNTIME: (500, "internal_error"),
}


def worker_error(error_code: str, error_message: str | None, index: int, retry_after_s: int) -> ApiError:
    status, code = WORKER_ERRORS.get(error_code, (500, "internal_error"))
    detail = f"input {index}: worker reported {error_code}"
    if error_message:
        detail += f": {error_message}"
    headers = {"Retry-After": str(retry_after_s)} if status == 503 else None
    return ApiError(status, code, detail, headers)
