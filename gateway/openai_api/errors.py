"""Errors as OpenAI's clients expect them: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status that matches the gRPC status the same request gets from ``Generate``.

The gRPC path decides what went wrong (``common.status`` maps exceptions to codes); this module only
translates: an HTTP client and a gRPC client of the same request see the same failure in their own terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
from pydantic import ValidationError

from common.status import DEFAULT_STATUSES
from gateway.validation import UnknownModel

# gRPC status -> (HTTP status, OpenAI error type, code)
HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", None),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error", None),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", None),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", None),
}
INTERNAL = (500, "internal_error", None)


@dataclass(slots=True)
class ApiError(Exception):
    """An error response: its HTTP status and the OpenAI error object's fields."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None  # seconds, for 429 and 503

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


def from_status(code: grpc.StatusCode, message: str, retry_after: float | None = None) -> ApiError:
    status, kind, short = HTTP_OF.get(code, INTERNAL)
    return ApiError(status, message, kind, None, short, retry_after)


def from_exception(exc: BaseException, retry_after: float | None = None) -> ApiError:
    """What a request that raised ``exc`` answers: the status ``Generate`` would end with, in HTTP terms."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation(exc)
    if isinstance(exc, UnknownModel):
        return ApiError(404, str(exc), "not_found_error", "model", "model_not_found")
    code, message = DEFAULT_STATUSES.status(exc) if isinstance(exc, Exception) else (grpc.StatusCode.CANCELLED, "")
    return from_status(code, message, retry_after)


def from_validation(exc: ValidationError) -> ApiError:
    """A body of the wrong shape: 400 naming the first field that is wrong."""
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(p) for p in first["loc"] if not _union_member(p)) or None
    if any(_union_member(p) for p in first["loc"]):
        message = f"`{param}` has none of the types it may have ({first['msg'].lower()}, ...)"
    else:
        message = f"`{param}`: {first['msg']}" if param else first["msg"]
    return ApiError(400, message, "invalid_request_error", param)


def _union_member(part: object) -> bool:
    """pydantic names the member of a union it tried (``str``, ``list[int]``) in an error's location."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body is {size} bytes; the limit is {limit}", "invalid_request_error", None,
                    "request_too_large")
