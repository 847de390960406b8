"""The gateway's error contract: JSON `{"error": {"code", "message"}}` with the right HTTP status.

A failure inside the gateway (a bug, not the client's fault) is answered 500 with a generic message and a
request id (`internal_error`), never the exception's text: that may name paths, addresses or secrets. The
traceback goes to the gateway's log under the same id, where an operator finds it.

A worker's failure (`worker_error`) is answered the same way: a stable code, the request's id (in the body and
the `X-Request-Id` header, the id its tasks carry, so the worker's log has it too) and a message written here.
The worker's own text (`MemoryError: [enforce fail at alloc_cpu.cpp:116]…`, an adapter's path) goes to the
gateway's log under that id, never to the client. The one exception is `invalid_request` (400): the runtime
refused the client's own input or parameters, and its message says what to change.
"""

from __future__ import annotations

import logging
import uuid

import orjson
from starlette.responses import Response

from lorafleet.core import wire


class ApiError(Exception):
    """An error answered to the client; `message` says what to fix. `request_id`: the id it is answered with
    (body and header), where the gateway's log has the details."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.request_id = request_id

    def response(self) -> Response:
        return error_response(self.status, self.code, self.message, self.headers, self.request_id)


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


log = logging.getLogger("lorafleet.serve")

# Worker error codes (wire.ERR_*) → (HTTP status, public code, what the client is told). Only the code and these
# words reach the client; the worker's message is logged (worker_error).
WORKER_ERRORS: dict[str, tuple[int, str, str]] = {
    wire.ERR_DEADLINE: (504, "deadline_exceeded", "input {index}: the deadline passed before a worker computed it; "
                        "send a longer X-Lorafleet-Deadline-Ms, or retry when the queue is shorter"),
    wire.ERR_ADAPTER: (503, "adapter_unavailable", "the adapter of this model could not be loaded on a worker; retry "
                       "later, and quote request id {request_id} to the operator if it persists"),
    wire.ERR_MALFORMED: (500, "internal_error", "input {index} failed inside the fleet; quote request id "
                         "{request_id} to its operator"),
    wire.ERR_RUNTIME: (500, "internal_error", "a worker failed computing input {index}; quote request id "
                       "{request_id} to its operator"),
    wire.ERR_INVALID: (400, "invalid_request", "input {index}: the model refused it: {detail}"),
}
_UNKNOWN = (500, "internal_error", "input {index} failed on a worker; quote request id {request_id} to its operator")


def worker_error(result: wire.Result, request_id: str, retry_after_s: int) -> ApiError:
    """The answer to a request whose task failed on a worker (or whose result the gateway could not use): logged
    with the worker's message under `request_id`, answered with a stable code and that id only."""
    code = result.error_code or "unknown"
    status, public, template = WORKER_ERRORS.get(code, _UNKNOWN)
    detail = " ".join((result.error_message or "").split())  # one log line, whatever the worker sent
    log.log(logging.INFO if status < 500 or status == 504 else logging.WARNING,
            "request %s: input %d failed on worker %s: %s: %s", request_id, result.index, result.worker or "?",
            code, detail or "(no message)")
    # The runtime's refusal of the client's input is for the client (a prompt over the context, …), shortened.
    message = template.format(index=result.index, request_id=request_id,
                              detail=clip(detail or "no reason given", 300))
    headers = {"Retry-After": str(retry_after_s)} if status == 503 else None
    return ApiError(status, public, message, headers, request_id=request_id)
