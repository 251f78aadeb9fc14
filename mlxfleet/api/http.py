"""HTTP helpers shared by the gateway and the worker apps (both Quart)."""

from __future__ import annotations

import json
import logging
from typing import Any

from quart import Quart, Response, request

from .protocol import APIError, error_type_for

log = logging.getLogger("mlxfleet.http")


def error_response(err: APIError) -> Response:
    resp = Response(json.dumps(err.body()), status=err.status,
                    content_type="application/json")
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
