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
from quart import Quart, Response, g, request

from ..wire import APIError, install_error_handlers, parse_json_body, sse, streaming_response

log = logging.getLogger("mlxfleet.gateway")

#: Routes forwarded to the worker named by the body's ``model``.
MODEL_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages",
                "/v1/messages/count_tokens", "/v1/embeddings"]
_FORWARD_HEADERS = ("content-type", "accept", "x-request-id")


def create_gateway(supervisor: Any) -> Quart:
    """The public app. ``supervisor`` resolves names and owns the workers."""
    from .control import register_control
    from .guard import install_guard
    from .metrics import Metrics

    settings = supervisor.settings
    app = Quart("mlxfleet.gateway")
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=60,
                      MAX_CONTENT_LENGTH=settings.max_body_mb << 20)
    install_error_handlers(app)
    install_guard(app, settings.api_keys, settings.rate_limit)
    metrics = Metrics(supervisor)
    metrics.install(app, enabled=settings.enable_metrics)
    started = time.time()

    @app.get("/v1/status")
    async def status():
        """Every model's engine status (the fields vllm-mlx documents), in one answer."""
        return await metrics.status()

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
        if "keep_alive" in body:
            rt.keep_alive_override = _keep_alive(body["keep_alive"])
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        headers["X-Request-Id"] = g.request_id
        g.model = rt.name
        timeout = rt.manifest.spec.limits.timeout or settings.timeout
        deadline = time.monotonic() + timeout
        target = (request.method, request.path, raw, headers)
        if not rt.ready and body.get("stream") is True:
            # Start the SSE stream now and keep it alive with comments while the
            # model loads, so clients and proxies do not time out.
            _check_queue(rt)
            return streaming_response(metrics.observe_stream(
                _stream_after_load(supervisor, rt, target, deadline), rt.name))
        try:
            await asyncio.wait_for(_until_ready(supervisor, rt), _left(deadline))
        except asyncio.TimeoutError:
            raise _timeout_error(rt, timeout) from None
        upstream, worker = await _send(supervisor, rt, target)
        ctype = upstream.headers.get("content-type", "application/json")
        if not ctype.startswith("text/event-stream"):
            try:
                content = await asyncio.wait_for(upstream.aread(), _left(deadline))
            except asyncio.TimeoutError:
                raise _timeout_error(rt, timeout) from None
            except httpx.TransportError as e:
                raise APIError(502, f"The worker for model '{rt.name}' failed mid-request: "
                               f"{e}", type="server_error", code="worker_failed") from None
            finally:
                await upstream.aclose()  # on timeout this aborts the generation in the worker
                rt.end(worker)
            return Response(content, status=upstream.status_code, content_type=ctype)
        return streaming_response(
            metrics.observe_stream(_relay(rt, upstream, worker, deadline), rt.name),
            status=upstream.status_code, content_type=ctype)

    for route in MODEL_ROUTES:
        app.add_url_rule(route, endpoint=route, view_func=forward, methods=["POST"])

    register_control(app, supervisor)
    return app


def _available(supervisor: Any) -> list[str]:
    return supervisor.names() + sorted(supervisor.aliases)


def _keep_alive(value: Any) -> float:
    from ..units import parse_duration

    try:
        return parse_duration(value)
    except ValueError as e:
        raise APIError(400, f"Invalid keep_alive: {e}", param="keep_alive",
                       code="invalid_value") from None


def _check_queue(rt: Any) -> None:
    limit = rt.manifest.spec.batching.max_queue
    if rt.waiters >= limit:
        raise APIError(503, f"Model '{rt.name}' has {rt.waiters} requests waiting for it to "
                       f"load (maxQueue {limit}); retry shortly.", type="service_unavailable",
                       code="queue_full", headers={"Retry-After": "2"})


async def _until_ready(supervisor: Any, rt: Any) -> None:
    """Load the model if needed (one load, shared by every waiter) and wait for it."""
    from ..supervisor.supervisor import LoadRefused

    if rt.ready and rt.want_loaded:
        return
    if rt.phase == "CrashLoopBackOff":
        retry = max(1, int((rt.backoff_until or time.monotonic()) - time.monotonic()) + 1)
        raise APIError(503, f"Model '{rt.name}' is not available: {rt.last_error}. "
                       f"Restarting in about {retry}s.", type="service_unavailable",
                       code="model_unavailable", headers={"Retry-After": str(retry)})
    _check_queue(rt)
    timeout = supervisor.settings.request_wait_timeout
    rt.waiters += 1
    try:
        deadline = time.monotonic() + timeout
        while not (rt.ready and rt.want_loaded):
            await supervisor.ensure_loaded(rt)
            await rt.wait_ready(max(0.1, deadline - time.monotonic()))
    except LoadRefused as e:
        raise APIError(503, str(e), type="service_unavailable", code=e.code,
                       headers={"Retry-After": str(max(1, round(e.retry_after)))}) from None
    except RuntimeError as e:  # the load failed: every waiter hears why
        raise APIError(503, f"Model '{rt.name}' failed to load: {e}",
                       type="service_unavailable", code="model_load_failed",
                       headers={"Retry-After": str(max(1, round(rt.retry_after())))}) from None
    except (asyncio.TimeoutError, TimeoutError):
        raise APIError(503, f"Model '{rt.name}' did not become ready in {timeout:.0f}s"
                       + (f": {rt.last_error}" if rt.last_error else "."),
                       type="service_unavailable", code="model_unavailable",
                       headers={"Retry-After": "5"}) from None
    finally:
        rt.waiters -= 1


async def _send(supervisor: Any, rt: Any, target: tuple):
    """Forward (method, path, body, headers) to the model's worker; (response, worker)."""
    method, path, raw, headers = target
    for attempt in range(2):
        worker = rt.begin()
        try:
            upstream = await worker.forward(method, path, raw, headers)
            return upstream, worker
        except httpx.TransportError as e:
            rt.end(worker)
            # Nothing reached the worker (it just crashed or is stopping):
            # wait for the model to come back once, then give up cleanly.
            if attempt == 1 or not isinstance(e, httpx.ConnectError):
                raise APIError(502, f"The worker for model '{rt.name}' failed: {e}",
                               type="server_error", code="worker_unavailable") from None
            await asyncio.sleep(0.2)
            await _until_ready(supervisor, rt)
        except BaseException:
            rt.end(worker)
            raise
    raise AssertionError("unreachable")


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _timeout_error(rt: Any, timeout: float = 0) -> APIError:
    after = f" after {timeout:g}s" if timeout else ""
    return APIError(504, f"The request to model '{rt.name}' timed out{after}.",
                    type="timeout", code="timeout")


async def _relay(rt: Any, upstream: httpx.Response, worker: Any, deadline: float):
    chunks = upstream.aiter_raw()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), _left(deadline))
            except StopAsyncIteration:
                break
            yield chunk
    except asyncio.TimeoutError:
        err = _timeout_error(rt)
        log.warning("%s: %s", rt.name, err.message)
        yield sse(err.body()).encode() + b"data: [DONE]\n\n"
    except httpx.TransportError as e:
        log.warning("%s: stream broke: %s", rt.name, e)
        err = APIError(502, f"The worker for model '{rt.name}' failed mid-stream.",
                       type="server_error", code="worker_failed")
        yield sse(err.body()).encode() + b"data: [DONE]\n\n"
    finally:
        await upstream.aclose()
        rt.end(worker)


async def _stream_after_load(supervisor: Any, rt: Any, target: tuple, deadline: float):
    load = asyncio.ensure_future(_until_ready(supervisor, rt))
    try:
        while True:
            done, _ = await asyncio.wait({load},
                                         timeout=supervisor.settings.sse_keepalive_interval)
            if done:
                break
            yield f": loading model {rt.name}\n\n".encode()
        load.result()
        upstream, worker = await _send(supervisor, rt, target)
    except APIError as err:
        yield sse(err.body()).encode() + b"data: [DONE]\n\n"
        return
    finally:
        if not load.done():
            load.cancel()
    if upstream.status_code != 200:  # e.g. a 400 from the worker: report it in-band
        body = await upstream.aread()
        await upstream.aclose()
        rt.end(worker)
        yield b"data: " + body.strip() + b"\n\ndata: [DONE]\n\n"
        return
    async for chunk in _relay(rt, upstream, worker, deadline):
        yield chunk
