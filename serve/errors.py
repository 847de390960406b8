"""The gateway's error contract: JSON `{"error": {"code", "message"}}` with the right HTTP status."""

from __future__ import annotations

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


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    body = orjson.dumps({"error": {"code": code, "message": message}})
    return Response(body, status_code=status, headers=headers, media_type="application/json")


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
