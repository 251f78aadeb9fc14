"""Wire code shared by the gateway and the worker: errors, JSON bodies, SSE.

Neither side owns this module; both import it. An ``APIError`` raised anywhere
leaves as the protocol's own error shape: OpenAI's ``{"error": {...}}``,
Anthropic's ``{"type": "error", ...}`` on the ``/v1/messages`` routes, or
Ollama's ``{"error": "..."}`` on ``/api/...``, as a JSON response or, once a
stream has started, as an in-band event.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any, Optional, TypeVar

from pydantic import BaseModel, ValidationError
from quart import Quart, Response, request

log = logging.getLogger("mlxfleet.http")


class APIError(Exception):
    """An error that becomes an OpenAI-shaped JSON response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    @classmethod
    def answered(cls, status: int, body: bytes, who: str,
                 headers: Optional[Mapping[str, str]] = None) -> APIError:
        """The error another server of ours (a worker, a node) answered, raised again
        here: its message, type, code and param when the body is an error shape we
        write (OpenAI's, Anthropic's, Ollama's), else what ``who`` answered."""
        try:
            err = json.loads(body).get("error")
        except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):
            err = None
        if isinstance(err, str):  # Ollama's shape
            err = {"message": err}
        err = err if isinstance(err, dict) else {}
        retry = {"Retry-After": headers["retry-after"]} \
            if headers and "retry-after" in headers else None
        return cls(status, str(err.get("message") or f"{who} answered HTTP {status}"),
                   type=err.get("type") or error_type_for(status), param=err.get("param"),
                   code=err.get("code"), headers=retry)


def error_type_for(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    return {400: "invalid_request_error", 401: "authentication_error",
            403: "permission_error", 404: "not_found_error", 413: "invalid_request_error",
            429: "rate_limit_error", 503: "service_unavailable",
            504: "timeout"}.get(status, "server_error" if status >= 500
                                else "invalid_request_error")


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not isinstance(part, str) or part in ("str", "list[str]", "list[int]"):
            continue
        elif "[" in part or part.startswith(("function-", "tagged-union")):
            continue  # pydantic's names for union members are noise to a client
        else:
            out += ("." if out else "") + part
    return out


def from_validation_error(err: ValidationError) -> APIError:
    """Turn pydantic's error into a 400 naming the first bad field."""
    first = err.errors()[0]
    param = _loc(first["loc"]) or None
    msg = first["msg"]
    if first["type"] == "missing":
        message = f"Missing required parameter: '{param}'."
    elif first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: '{param}'."
    else:
        message = f"Invalid value for '{param}': {msg}." if param else f"{msg}."
    return APIError(400, message, param=param, code="invalid_value"
                    if first["type"] != "missing" else "missing_required_parameter")


#: Request fields the gateway acts on; workers accept and ignore them.
GATEWAY_FIELDS = frozenset({"keep_alive", "mlxfleet_history", "mlxfleet_response_id",
                            "cache_salt"})
#: The prompt-cache scope the gateway gives a request (a hash of its key and
#: ``cache_salt``): a worker reuses cached prompts only within one scope.
CACHE_SCOPE_HEADER = "X-Mlxfleet-Cache-Scope"

#: Set by the gateway on a Responses request whose ``input`` already holds the history
#: that ``previous_response_id`` names (workers keep no responses).
HISTORY_FIELD = "mlxfleet_history"
#: Set by the gateway on a Responses request: the id the response gets (the gateway
#: stores it under that id; in a fleet the id names the storing node).
RESPONSE_ID_FIELD = "mlxfleet_response_id"


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body or raise a 400 that says what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}. "
                       "The body must be a JSON object.", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "The JSON body is nested too deeply.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object, not "
                       f"{type(body).__name__}.", code="invalid_json")
    return body




M = TypeVar("M", bound=BaseModel)


def parse_model(model_cls: type[M], body: dict[str, Any]) -> M:
    """Validate ``body`` as ``model_cls``; errors become 400s naming the field."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 529: "overloaded_error"}


def anthropic_body(err: APIError) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(err.status, "api_error" if err.status >= 500
                                     else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def protocol(path: Optional[str] = None) -> str:
    """Which protocol a route speaks, for its error shape: ``anthropic`` (/v1/messages),
    ``ollama`` (/api/...) or ``openai`` (the rest). ``path`` defaults to this request's."""
    if path is None:
        try:
            path = request.path
        except RuntimeError:  # outside a request
            return "openai"
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    if path.startswith("/v1/responses"):
        return "responses"
    return "openai"


def error_body(err: APIError, path: Optional[str] = None) -> dict[str, Any]:
    """The error in the shape of the protocol ``path`` (default: this request's) speaks:
    Anthropic's typed object, Ollama's ``{"error": "..."}``, or OpenAI's."""
    kind = protocol(path)
    if kind == "anthropic":
        return anthropic_body(err)
    if kind == "ollama":
        return {"error": err.message}
    return err.body()


def stream_error(err: APIError, path: Optional[str] = None, sequence_number: int = 0) -> str:
    """The error as the last event of a stream that has already started
    (``sequence_number``: the Responses API's number for it, one past the last sent)."""
    kind = protocol(path)
    if kind == "anthropic":
        return f"event: error\ndata: {json.dumps(anthropic_body(err))}\n\n"
    if kind == "ollama":  # NDJSON: Ollama's clients raise on an "error" line
        return json.dumps({"error": err.message}) + "\n"
    if kind == "responses":  # the Responses API's typed error event
        data = {"type": "error", "code": err.code, "message": err.message,
                "param": err.param, "sequence_number": sequence_number}
        return f"event: error\ndata: {json.dumps(data)}\n\n"
    return sse(err.body()) + "data: [DONE]\n\n"


def error_response(err: APIError) -> Response:
    body = error_body(err)
    resp = Response(json.dumps(body), status=err.status, content_type="application/json")
    for k, v in err.headers.items():
        resp.headers[k] = v
    return resp


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def body_too_large() -> APIError:
    """A request body over the server's limit (Quart's routes and the model routes)."""
    return APIError(413, "The request body is too large.", code="request_too_large")


def body_too_slow() -> APIError:
    """A request body that did not arrive within the body timeout."""
    return APIError(408, "The request body did not arrive in time.", code="request_timeout")


async def _drain_body() -> None:
    """Receive what is left of the request's body before an answer that does not read it.
    Hypercorn closes a keep-alive connection, with no ``Connection: close``, when an answer
    ends before the request's body has arrived, and the client's next request on that
    connection fails ("Server disconnected"; under load, 1 in 365 POSTs to an unknown
    route). The body's own limits and timeout still apply; past them, answer anyway."""
    try:
        await request.get_data(cache=False)
    except Exception:  # noqa: BLE001 - too large, too slow, or gone: the answer stands
        pass


def install_error_handlers(app: Quart) -> None:
    """Every error, ours or the framework's, leaves in OpenAI's error shape."""

    @app.errorhandler(APIError)
    async def _api_error(err: APIError):
        return error_response(err)

    @app.errorhandler(404)
    async def _not_found(_):
        await _drain_body()
        return error_response(APIError(404, f"Unknown route {request.method} {request.path}.",
                                       type="not_found_error", code="unknown_route"))

    @app.errorhandler(405)
    async def _bad_method(_):
        await _drain_body()
        return error_response(APIError(405, f"Method {request.method} is not allowed on "
                                       f"{request.path}.", code="method_not_allowed"))

    @app.errorhandler(413)
    async def _too_large(_):
        return error_response(body_too_large())

    @app.errorhandler(408)
    async def _slow_body(_):
        return error_response(body_too_slow())

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


# ---- Ollama -----------------------------------------------------------------

def ollama_time(ts: Optional[float] = None) -> str:
    """Ollama's timestamps: ISO 8601 in UTC with a ``Z`` (now when ``ts`` is None)."""
    t = datetime.fromtimestamp(time.time() if ts is None else ts, timezone.utc)
    return t.isoformat().replace("+00:00", "Z")


def ollama_empty_request(path: str, body: dict[str, Any]) -> bool:
    """Ollama's empty request, with nothing to generate: it loads the model, or unloads
    it with ``keep_alive: 0`` (``/api/chat`` without messages, ``/api/generate``
    without a prompt or images)."""
    if path == "/api/chat":
        return not body.get("messages")
    if path == "/api/generate":
        return not (body.get("prompt") or body.get("images"))
    return False


def ollama_done(model: str, path: str, reason: str = "load") -> dict[str, Any]:
    """Ollama's answer to an empty request: ``done_reason`` "load" or "unload"."""
    empty: Any = {"role": "assistant", "content": ""} if path == "/api/chat" else ""
    return {"model": model, "created_at": ollama_time(),
            "message" if path == "/api/chat" else "response": empty, "done": True,
            "done_reason": reason}
