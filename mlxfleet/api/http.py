"""HTTP helpers shared by the gateway and the worker apps (both Quart)."""

from __future__ import annotations

import json
import logging
from typing import Any

from quart import Quart, Response, request

from .protocol import APIError, error_type_for

log = logging.getLogger("mlxfleet.http")


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 529: "overloaded_error"}


def anthropic_body(err: APIError) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(err.status, "api_error" if err.status >= 500
                                     else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def is_anthropic() -> bool:
    """Requests to the Anthropic routes get Anthropic's error shape."""
    try:
        return request.path.startswith("/v1/messages")
    except RuntimeError:  # outside a request
        return False


def error_response(err: APIError) -> Response:
    body = anthropic_body(err) if is_anthropic() else err.body()
    resp = Response(json.dumps(body), status=err.status, content_type="application/json")
    for k, v in err.headers.items():
        resp.headers[k] = v
    return resp


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def install_error_handlers(app: Quart) -> None:
    """Every error, ours or the framework's, leaves in OpenAI's error shape."""

    @app.errorhandler(APIError)
    async def _api_error(err: APIError):
        return error_response(err)

    @app.errorhandler(404)
    async def _not_found(_):
        return error_response(APIError(404, f"Unknown route {request.method} {request.path}.",
                                       type="not_found_error", code="unknown_route"))

    @app.errorhandler(405)
    async def _bad_method(_):
        return error_response(APIError(405, f"Method {request.method} is not allowed on "
                                       f"{request.path}.", code="method_not_allowed"))

    @app.errorhandler(413)
    async def _too_large(_):
        return error_response(APIError(413, "The request body is too large.",
                                       code="request_too_large"))

    @app.errorhandler(Exception)
    async def _unexpected(err: Exception):
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(APIError(500, f"Internal error: {type(err).__name__}: {err}",
                                       type=error_type_for(500), code="internal_error"))


def streaming_response(body, status: int = 200,
                       content_type: str = "text/event-stream") -> Response:
    resp = Response(body, status=status, content_type=content_type)
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    resp.timeout = None
    return resp
