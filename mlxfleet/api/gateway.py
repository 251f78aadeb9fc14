"""The gateway: one public port, routing OpenAI requests to workers by ``model``.

It runs in the supervisor's process and event loop, asks the supervisor which
worker serves a name or alias, and forwards the request over that worker's
Unix socket, streaming the answer back chunk by chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
from quart import Quart, Response, request

from .http import install_error_handlers, sse, streaming_response
from .protocol import APIError, parse_json_body

log = logging.getLogger("mlxfleet.gateway")

#: Routes forwarded to the worker named by the body's ``model``.
MODEL_ROUTES = ["/v1/chat/completions", "/v1/completions"]
_FORWARD_HEADERS = ("content-type", "accept", "x-request-id")


def create_gateway(supervisor: Any) -> Quart:
    """The public app. ``supervisor`` resolves names and owns the workers."""
    from .control import register_control

    app = Quart("mlxfleet.gateway")
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=60, MAX_CONTENT_LENGTH=32 << 20)
    install_error_handlers(app)
    started = time.time()

    @app.get("/health")
    async def health():
        names = supervisor.names()
        ready = [n for n in names if supervisor.models[n].ready]
        return {"status": "ok", "models": len(names), "ready": len(ready)}

    @app.get("/v1/models")
    async def models():
        data = []
        for n in supervisor.names():
            rt = supervisor.models[n]
            data.append({"id": n, "object": "model", "created": int(rt.created or started),
                         "owned_by": "mlxfleet", "state": rt.phase, "ready": rt.ready,
                         "aliases": list(rt.manifest.spec.aliases)})
        return {"object": "list", "data": data}

    async def forward() -> Response:
        raw = await request.get_data()
        body = parse_json_body(raw)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise APIError(400, "You must provide a model parameter.", param="model",
                           code="missing_required_parameter")
        rt = supervisor.resolve(model)
        if rt is None:
            raise APIError(404, f"The model '{model}' does not exist. Available models: "
                           f"{', '.join(_available(supervisor)) or 'none'}.",
                           param="model", code="model_not_found")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        for attempt in range(2):
            worker = await _ready_worker(rt, supervisor.settings.request_wait_timeout)
            worker.acquire()
            try:
                upstream = await worker.client.send(
                    worker.client.build_request(request.method, request.path, content=raw,
                                                headers=headers), stream=True)
                break
            except httpx.TransportError as e:
                worker.release()
                # Nothing reached the worker (it just crashed or is stopping):
                # wait for the model to come back once, then give up cleanly.
                if attempt == 1 or not isinstance(e, httpx.ConnectError):
                    raise APIError(502, f"The worker for model '{rt.name}' failed: {e}",
                                   type="server_error", code="worker_unavailable") from None
                await asyncio.sleep(0.2)
            except BaseException:
                worker.release()
                raise
        ctype = upstream.headers.get("content-type", "application/json")
        if not ctype.startswith("text/event-stream"):
            try:
                content = await upstream.aread()
            except httpx.TransportError as e:
                raise APIError(502, f"The worker for model '{rt.name}' failed mid-request: "
                               f"{e}", type="server_error", code="worker_failed") from None
            finally:
                await upstream.aclose()
                worker.release()
            return Response(content, status=upstream.status_code, content_type=ctype)

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.TransportError as e:
                log.warning("%s: stream broke: %s", rt.name, e)
                err = APIError(502, f"The worker for model '{rt.name}' failed mid-stream.",
                               type="server_error", code="worker_failed")
                yield sse(err.body()).encode() + b"data: [DONE]\n\n"
            finally:
                await upstream.aclose()
                worker.release()

        return streaming_response(relay(), status=upstream.status_code, content_type=ctype)

    for route in MODEL_ROUTES:
        app.add_url_rule(route, endpoint=route, view_func=forward, methods=["POST"])

    register_control(app, supervisor)
    return app


def _available(supervisor: Any) -> list[str]:
    return supervisor.names() + sorted(supervisor.aliases)


async def _ready_worker(rt: Any, timeout: float):
    """The worker serving ``rt``; waits while it starts, 503 if it cannot serve."""
    if rt.ready:
        return rt.current
    if rt.phase == "CrashLoopBackOff":
        retry = max(1, int((rt.backoff_until or time.monotonic()) - time.monotonic()) + 1)
        raise APIError(503, f"Model '{rt.name}' is not available: {rt.last_error}. "
                       f"Restarting in about {retry}s.", type="service_unavailable",
                       code="model_unavailable", headers={"Retry-After": str(retry)})
    try:
        return await rt.wait_ready(timeout)
    except (asyncio.TimeoutError, TimeoutError):
        raise APIError(503, f"Model '{rt.name}' did not become ready in {timeout:.0f}s"
                       + (f": {rt.last_error}" if rt.last_error else "."),
                       type="service_unavailable", code="model_unavailable",
                       headers={"Retry-After": "5"}) from None


