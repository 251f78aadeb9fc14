"""The gateway: one public port, routing requests to workers by ``model``.

It runs in the supervisor's process and event loop. For every model route:
read ``model`` -> ``supervisor.acquire`` (a lease on a ready worker, loading it
on demand) -> forward over the worker interface -> relay the answer, streaming
chunk by chunk. Errors leave in the protocol's own shape (``wire``), including
in-band once a stream has started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx
from quart import Quart, Response, g, request

from ..supervisor.admission import AdmissionError, Lease, time_left, timeout_error
from ..units import parse_duration
from ..wire import (
    APIError,
    install_error_handlers,
    parse_json_body,
    stream_error,
    streaming_response,
)
from .mcp import register_mcp, respond_with_mcp
from .metrics import Metrics, tag_model
from .ollama import load_or_unload, register_ollama
from .responses import ResponseStore, register_responses

log = logging.getLogger("mlxfleet.gateway")

#: Routes forwarded to the worker named by the body's ``model``.
MODEL_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages",
                "/v1/messages/count_tokens", "/v1/embeddings",
                "/api/chat", "/api/generate", "/api/embed", "/api/embeddings",
                "/v1/responses"]
#: Content types relayed chunk by chunk (SSE, and Ollama's NDJSON).
_STREAMING = ("text/event-stream", "application/x-ndjson")
_FORWARD_HEADERS = ("content-type", "accept")  # X-Request-Id: the guard's, sanitized


def create_gateway(supervisor: Any, mcp: Any = None) -> Quart:
    """The public app. ``supervisor`` resolves names and owns the workers."""
    from .control import register_control
    from .dashboard import register_dashboard
    from .guard import install_guard

    settings = supervisor.settings
    app = Quart("mlxfleet.gateway")
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=settings.body_timeout,
                      MAX_CONTENT_LENGTH=settings.max_body_mb << 20)
    install_error_handlers(app)
    install_guard(app, settings.api_keys, settings.rate_limit, settings.admin_keys,
                  settings.fleet_key, fleet=bool(settings.node))
    metrics = Metrics(supervisor)
    store = ResponseStore(settings.responses_store_max, settings.responses_store_mb << 20,
                          settings.responses_ttl)
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
        """Every model of the fleet; ``node`` says which node runs it (null on a single
        machine, and for a model no node can run)."""
        data = []
        for rt in supervisor.entries():
            data.append({"id": rt.name, "object": "model",
                         "created": int(rt.created or started), "owned_by": "mlxfleet",
                         "state": rt.phase.value, "ready": rt.ready,
                         "aliases": list(rt.manifest.spec.aliases),
                         "node": rt.node if rt.remote else supervisor.node_name})
        return {"object": "list", "data": data}

    async def forward() -> Response:
        raw = await request.get_data()
        body = parse_json_body(raw)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise APIError(400, "You must provide a model parameter.", param="model",
                           code="missing_required_parameter")
        keep_alive = _keep_alive(body["keep_alive"]) if "keep_alive" in body else None
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        headers["X-Request-Id"] = g.request_id
        rt = supervisor.resolve(model)
        remote = rt is not None and rt.remote  # another node runs it (and loads it)
        if remote and g.get("forwarded_by"):
            raise _moved(rt, supervisor.node_name)
        timeout = (rt.manifest.spec.limits.timeout if rt else None) or settings.timeout
        deadline = time.monotonic() + timeout
        ollama = request.path.startswith("/api/")
        if ollama and not remote:
            done = await load_or_unload(supervisor, request.path, body, model, keep_alive,
                                        deadline)
            if done is not None:
                return done
        pending = None
        if request.path == "/v1/responses":
            sent, pending = store.prepare(body)
            if sent is not body:
                raw = json.dumps(sent).encode()
            if any(isinstance(t, dict) and t.get("type") == "mcp"
                   for t in sent.get("tools") or []):
                resp = await respond_with_mcp(mcp, sent, lambda b: _ask_worker(
                    supervisor, model, deadline, keep_alive, b, headers))
                store.put(resp, pending)
                return resp

        def relayed(chunks):
            return store.capture_stream(chunks, pending) if pending else chunks

        target = (request.method, request.path, raw, headers)
        acquire = supervisor.acquire(model, deadline, keep_alive)
        if rt is not None and not remote and not rt.ready and body.get("stream") is True \
                and not ollama:
            # Start the SSE stream now and keep it alive with comments while the
            # model loads, so clients and proxies do not time out.
            tag_model(rt.name)
            return streaming_response(metrics.observe_stream(relayed(
                _stream_after_load(acquire, target, timeout, supervisor.settings)), rt.name))
        lease = await acquire
        tag_model(lease.name)
        try:
            upstream = await lease.send(*target)
        except BaseException:
            lease.release()
            raise
        ctype = upstream.headers.get("content-type", "application/json")
        if not ctype.startswith(_STREAMING):
            try:
                content = await asyncio.wait_for(upstream.aread(), time_left(deadline))
            except asyncio.TimeoutError:
                raise timeout_error(lease.name, timeout) from None
            except httpx.TransportError as e:
                raise APIError(502, f"The worker for model '{lease.name}' failed mid-request: "
                               f"{e}", type="server_error", code="worker_failed") from None
            finally:
                await upstream.aclose()  # on timeout this aborts the generation in the worker
                lease.release()
            if pending and upstream.status_code == 200:
                store.capture(content, pending)
            resp = Response(content, status=upstream.status_code, content_type=ctype)
            if "retry-after" in upstream.headers:  # a worker's 503 says when to come back
                resp.headers["Retry-After"] = upstream.headers["retry-after"]
            return resp
        return streaming_response(
            metrics.observe_stream(relayed(_relay(lease, upstream, request.path)),
                                   lease.name),
            status=upstream.status_code, content_type=ctype)

    for route in MODEL_ROUTES:
        app.add_url_rule(route, endpoint=route, view_func=forward, methods=["POST"])

    register_control(app, supervisor)
    register_ollama(app, supervisor)
    register_dashboard(app)
    register_responses(app, store)
    register_mcp(app, mcp)
    return app


async def _ask_worker(supervisor: Any, model: str, deadline: float, keep_alive: Any,
                      body: dict, headers: dict) -> dict:
    """One non-streaming /v1/responses round on the model's worker (the MCP tool loop)."""
    async with supervisor.acquire(model, deadline, keep_alive) as lease:
        upstream = await lease.send("POST", "/v1/responses", json.dumps(body).encode(),
                                    headers)
        try:
            content = await asyncio.wait_for(upstream.aread(), time_left(deadline))
        except asyncio.TimeoutError:
            raise timeout_error(lease.name) from None
        finally:
            await upstream.aclose()
    data = json.loads(content)
    if upstream.status_code != 200:
        err = data.get("error") or {}
        raise APIError(upstream.status_code, err.get("message", "the model failed"),
                       type=err.get("type") or "server_error", param=err.get("param"),
                       code=err.get("code"))
    return data


def _moved(rt: Any, me: str) -> APIError:
    """A request another node forwarded here for a model this node does not run: the
    nodes' placements disagree for a moment (a node just came or went). It is refused,
    never forwarded again, so requests cannot go round in circles."""
    where = f"node '{rt.node}'" if rt.node else "no node"
    return AdmissionError(503, f"Model '{rt.name}' runs on {where}, not on node '{me}' that "
                          "this request was forwarded to; the nodes are updating their "
                          "placement, retry shortly.", "model_moved", retry_after=1)


def _keep_alive(value: Any) -> float:
    try:
        return parse_duration(value)
    except ValueError as e:
        raise APIError(400, f"Invalid keep_alive: {e}", param="keep_alive",
                       code="invalid_value") from None


async def _relay(lease: Lease, upstream: httpx.Response, path: str):
    """The worker's stream, chunk by chunk, until the request's deadline."""
    chunks = upstream.aiter_raw()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), time_left(lease.deadline))
            except StopAsyncIteration:
                break
            yield chunk
    except asyncio.TimeoutError:
        err = timeout_error(lease.name)
        log.warning("%s: %s", lease.name, err.message)
        yield stream_error(err, path).encode()
    except httpx.TransportError as e:
        log.warning("%s: stream broke: %s", lease.name, e)
        err = APIError(502, f"The worker for model '{lease.name}' failed mid-stream.",
                       type="server_error", code="worker_failed")
        yield stream_error(err, path).encode()
    finally:
        await upstream.aclose()
        lease.release()


async def _stream_after_load(acquire: Any, target: tuple, timeout: float, settings: Any):
    """A stream whose model is not loaded yet: keep-alive comments, then the answer."""
    path = target[1]
    load = asyncio.ensure_future(acquire)
    lease = None
    try:
        while True:
            done, _ = await asyncio.wait({load}, timeout=settings.sse_keepalive_interval)
            if done:
                break
            yield f": loading model {acquire.model}\n\n".encode()
        lease = load.result()
        upstream = await lease.send(*target)
    except AdmissionError as err:
        if lease is not None:
            lease.release()
        yield stream_error(err, path).encode()
        return
    except BaseException:  # the client left while we waited: give the worker back
        if lease is not None:
            lease.release()
        raise
    finally:
        if not load.done():
            load.cancel()
        elif lease is None and not load.cancelled() and load.exception() is None:
            load.result().release()  # acquired just as the client left
    if upstream.status_code != 200:  # e.g. a 400 from the worker: report it in-band
        body = await upstream.aread()
        await upstream.aclose()
        lease.release()
        yield _in_band(body, upstream.status_code, path).encode()
        return
    async for chunk in _relay(lease, upstream, path):
        yield chunk


def _in_band(body: bytes, status: int, path: str) -> str:
    """A worker's error response, re-sent as the last event of a started stream."""
    import json

    try:
        err = json.loads(body)["error"]
        message = err["message"] if isinstance(err, dict) else str(err)
        code = err.get("code") if isinstance(err, dict) else None
    except (ValueError, KeyError, TypeError):
        message, code = body.decode(errors="replace"), None
    return stream_error(APIError(status, message, code=code), path)
