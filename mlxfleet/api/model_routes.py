"""The model routes (``POST /v1/chat/completions`` and the rest of ``MODEL_ROUTES``) as a
lean ASGI app in front of Quart, which keeps every other route.

Every request takes this path, so it is plain ASGI: read ``model`` -> the guard ->
``model.lease`` (a worker the node's scheduler grants, loading it on demand) -> forward over
the worker interface -> relay the answer, streamed chunk by chunk as the worker wrote it.
Quart's request and response objects, context locals and hooks cost about a quarter of
the gateway's time per request (py-spy, ``benchmarks/hop.py``) and do nothing here.
Errors leave in the protocol's own shape (``wire``), in-band once a stream has started.
A client that hangs up is noticed at once (a watcher on ``receive``): its request is
cancelled, which closes the connection to the worker, which stops generating.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import httpx

from ..fleet_auth import HOPS_HEADER, MOVED_HEADER, Signed, hops_of
from ..fleet_tls import SCOPE_NODE
from ..names import loggable
from ..supervisor.admission import AdmissionError, Lease, time_left, timeout_error, until
from ..units import parse_duration
from ..wire import (
    CACHE_SCOPE_HEADER,
    APIError,
    body_too_large,
    body_too_slow,
    error_body,
    error_type_for,
    ollama_empty_request,
    parse_json_body,
    stream_error,
)
from .affinity import AFFINITY_HEADER, affinity_key
from .guard import Guard, request_id, target_of
from .mcp import respond_with_mcp
from .metrics import SCOPE_KEY, Metrics
from .ollama import load_or_unload
from .responses import ResponseStore, owner_of

if TYPE_CHECKING:
    from ..supervisor.admission import ServedModel
    from ..supervisor.supervisor import Supervisor

log = logging.getLogger("mlxfleet.gateway")

#: Routes forwarded to the worker named by the body's ``model``.
#: Content types relayed chunk by chunk (SSE, and Ollama's NDJSON).
_STREAMING = ("text/event-stream", "application/x-ndjson")
_FORWARD_HEADERS = ("content-type", "accept")  # X-Request-Id: the guard's, sanitized
_STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
#: What the last event of a complete stream carries, per protocol (OpenAI's [DONE],
#: Anthropic's message_stop, the Responses API's terminal events, Ollama's done line).
_FINAL_EVENTS = (b"data: [DONE]", b"event: message_stop", b'"response.completed"',
                 b'"response.incomplete"', b'"response.failed"', b'"done":true',
                 b'"done": true')


class ModelRoutes:
    """ASGI: the model routes here, anything else to ``fallback`` (the Quart app)."""

    def __init__(self, supervisor: Supervisor, guard: Guard, metrics: Metrics,
                 store: ResponseStore, mcp: Any, fallback: Any):
        self.sup, self.guard, self.metrics = supervisor, guard, metrics
        self.store, self.mcp, self.fallback = store, mcp, fallback
        settings = supervisor.settings
        self.settings = settings
        self.max_body = settings.max_body_mb << 20
        #: bytes of request bodies held now (read, or announced and being read): a flood
        #: of large bodies is refused before it is read (24 x 28 MB took the gateway
        #: from 143 MB to 1.9 GB while every one of them got 503 queue_full)
        self.held, self.max_held = 0, settings.max_pending_body_mb << 20

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" \
                or scope["path"] not in MODEL_ROUTES:
            return await self.fallback(scope, receive, send)
        t0 = time.perf_counter()
        path = scope["path"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        out = _Reply(send, request_id(headers.get("x-request-id")), path,
                     scope.get(SCOPE_KEY), self.metrics, t0)
        task = asyncio.current_task()
        watcher: Optional[asyncio.Future] = None
        held = [0]  # this request's share of self.held
        try:
            client = scope.get("client")
            sender = self.guard.check(path, "POST", headers, client[0] if client else "",
                                      target_of(scope), scope.get(SCOPE_NODE))
            raw = await self._body(receive, headers, held)
            if sender is not None and self.guard.verifier is not None \
                    and not sender.body_ok(raw):
                raise APIError(401, "The body does not match its fleet signature.",
                               type="authentication_error", code="invalid_fleet_key")
            watcher = asyncio.ensure_future(_hang_up(receive, task))
            await self._serve(path, raw, headers, sender, out)
        except APIError as err:
            await out.error(err)
        except _ClientGone:
            return  # hung up while sending its body: nobody to answer
        except asyncio.CancelledError:
            if watcher is None or not watcher.done() or watcher.cancelled():
                raise  # the server is stopping
            if hasattr(task, "uncancel"):
                task.uncancel()  # the client left: nothing more to send
        except Exception as err:  # a bug: say so in the protocol's shape, keep serving
            log.exception("unexpected error on POST %s", path)
            await out.error(APIError(500, f"Internal error: {type(err).__name__}: {err}",
                                     type=error_type_for(500), code="internal_error"))
        finally:
            self.held -= held[0]
            if watcher is not None:
                watcher.cancel()

    def _hold(self, held: list[int], size: int) -> None:
        """Count ``size`` bytes of this request's body as held (``held[0]``: what it holds
        already), or refuse it: the gateway holds at most ``max_pending_body_mb``."""
        more = size - held[0]
        if more <= 0:
            return
        if self.held + more > self.max_held and self.held > 0:  # (one body always fits)
            raise APIError(503, "The server is holding as many request bodies as it may "
                           f"({self.max_held >> 20} MB, max_pending_body_mb); retry shortly.",
                           type="server_error", code="queue_full",
                           headers={"Retry-After": "1"})
        self.held += more
        held[0] = size

    async def _body(self, receive: Any, headers: dict[str, str], held: list[int]) -> bytes:
        """The whole body, at most ``max_body_mb``, within ``body_timeout``, counted
        against ``max_pending_body_mb`` before it is read (its Content-Length) and as it
        arrives (chunked)."""
        length = headers.get("content-length", "")
        if length.isdigit():
            if int(length) > self.max_body:
                raise body_too_large()
            self._hold(held, int(length))
        parts, size = [], 0
        try:
            async with until(time.monotonic() + self.settings.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _ClientGone
                    parts.append(message.get("body", b""))
                    size += len(parts[-1])
                    if size > self.max_body:
                        raise body_too_large()
                    self._hold(held, size)
                    if not message.get("more_body"):
                        return b"".join(parts)
        except (asyncio.TimeoutError, TimeoutError):
            raise body_too_slow() from None

    def _cache_scope(self, rt: ServedModel, body: dict, headers: dict[str, str],
                     sender: Optional[Signed]) -> str:
        """Whose cached prompts this request may reuse (``prompt_cache``'s scope): with
        API keys, its key's only (unless the model's ``cache.scope`` is shared), and a
        ``cache_salt`` (vLLM's) splits it further; "" is the public scope. A node that
        forwards a request has worked it out for its client."""
        if sender is not None:
            return headers.get(CACHE_SCOPE_HEADER.lower(), "")[:64]
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise APIError(400, "cache_salt must be a string", param="cache_salt",
                           code="invalid_type")
        shared = rt.manifest.spec.cache.scope == "shared"
        owner = "" if shared else owner_of(headers, bool(self.guard.api_keys), False)
        if not owner and not salt:
            return ""
        return hashlib.sha256(f"{owner}\0{salt or ''}".encode()).hexdigest()[:32]

    def _call(self, path: str, raw: bytes, headers: dict[str, str],
              sender: Optional[Signed], out: _Reply) -> _Call:
        """What every model route does first: the model named, its keep-alive (a
        client key extends it, never shortens it), the cache scope, the deadline."""
        settings = self.settings
        body = parse_json_body(raw)
        model = body.get("model")
        out.asked = model if isinstance(model, str) else None
        if not isinstance(model, str) or not model:
            raise APIError(400, "You must provide a model parameter.", param="model",
                           code="missing_required_parameter")
        keep_alive = _keep_alive(body["keep_alive"]) if "keep_alive" in body else None
        fwd = {k: headers[k] for k in _FORWARD_HEADERS if k in headers}
        fwd["X-Request-Id"] = out.request_id
        hops = hops_of(headers) if sender is not None else 0
        if hops:
            fwd[HOPS_HEADER] = str(hops + 1)  # if it goes on (find allows that once)
        key: list[str] = []  # the affinity key, worked out if the model is replicated

        def affinity() -> str:
            if not key:  # the routing node's, when it forwarded the request here
                given = headers.get(AFFINITY_HEADER) if sender is not None else None
                key.append(given[:300] if given else affinity_key(body, headers))
            return key[0]

        def find() -> ServedModel:
            return self.sup.find(model, sender.sender if sender is not None else None, hops,
                                 affinity)

        rt = find()
        if key:
            fwd[AFFINITY_HEADER] = key[0]
        scope = self._cache_scope(rt, body, headers, sender)
        if scope:
            fwd[CACHE_SCOPE_HEADER] = scope
        if keep_alive is not None and not rt.manifest.spec.client_keep_alive \
                and not self.guard.may_unload(headers, sender):
            floor = rt.manifest.spec.keep_alive
            floor = settings.keep_alive_seconds if floor is None else floor
            if keep_alive == 0 and ollama_empty_request(path, body):
                raise APIError(403, "Unloading a model needs the admin key "
                               "(MLXFLEET_ADMIN_KEY) unless its manifest sets "
                               "clientKeepAlive: true.", type="permission_error",
                               code="admin_key_required")
            if keep_alive < floor:
                keep_alive = floor
                body["keep_alive"] = -1 if math.isinf(floor) else floor
                raw = json.dumps(body).encode()
        timeout = rt.manifest.spec.limits.timeout or settings.timeout
        return _Call(path, body, raw, headers, fwd, sender, out, rt, find, keep_alive,
                     timeout, time.monotonic() + timeout)

    async def _serve(self, path: str, raw: bytes, headers: dict[str, str],
                     sender: Optional[Signed], out: _Reply) -> None:
        call = self._call(path, raw, headers, sender, out)
        route = ROUTES[path]
        if route.before is not None and await route.before(self, call):
            return  # the route answered it itself
        await self._forward(call, route.sse)

    async def _forward(self, call: _Call, sse: bool) -> None:
        """Send the request to a worker of its model and relay the answer."""
        rt, out, path = call.rt, call.out, call.path
        target = ("POST", path, call.raw, call.fwd)
        if not rt.ready and call.body.get("stream") is True and sse:
            # Start the SSE stream now and keep it alive with comments while the
            # model loads, so clients and proxies do not time out.
            out.model = rt.name
            return await out.stream(200, "text/event-stream", call.relayed(
                _stream_after_load(rt.lease(call.deadline, call.keep_alive), rt.name,
                                   target, self.settings.sse_keepalive_interval,
                                   call.timeout)))
        lease, upstream = await self._send(call, target)
        ctype = upstream.headers.get("content-type", "application/json")
        notices = [(k.encode(), v.encode()) for k, v in upstream.headers.items()
                   if k.startswith("x-mlxfleet-")]  # the worker's notices to the client
        if self.sup.node_name and "x-mlxfleet-node" not in upstream.headers:
            # in a fleet: which node ran it (another node's answer names its own)
            notices.append((b"x-mlxfleet-node", self.sup.node_name.encode()))
        if ctype.startswith(_STREAMING):
            return await out.stream(upstream.status_code, ctype, call.relayed(
                _relay(lease, upstream, path, call.timeout)), notices)
        try:
            async with until(call.deadline):
                content = await upstream.aread()
        except (asyncio.TimeoutError, TimeoutError):
            raise timeout_error(lease.name, call.timeout) from None
        except httpx.TransportError as e:
            raise APIError(502, f"The worker for model '{lease.name}' failed mid-request: "
                           f"{e}", type="server_error", code="worker_failed") from None
        finally:
            await upstream.aclose()  # on timeout this aborts the generation in the worker
            lease.release()
        if upstream.status_code == 200:
            await call.answered(content)
        extra = [(b"retry-after", upstream.headers["retry-after"].encode())] \
            if "retry-after" in upstream.headers else []  # a worker's 503: when to retry
        await out.send(upstream.status_code, ctype, content, extra + notices)

    async def _send(self, call: _Call, target: tuple) -> tuple[Lease, Any]:
        """A lease on the model, and the worker's answer to ``target``. A node that the
        request went to but that no longer holds the model (placements were changing as it
        was sent) refuses it having done nothing (``model_moved``): the model is looked up
        again and asked again as the nodes' views settle (up to four fleet polls), so the
        client never sees that refusal while another node serves the model."""
        delay, waited = 0.1, 0.0
        while True:
            lease = await call.rt.lease(call.deadline, call.keep_alive)
            call.out.model = lease.name  # (a client that hangs up now is counted on it)
            try:
                upstream = await lease.send(*target)
            except BaseException:
                lease.release()
                raise
            if upstream.status_code != 503 or MOVED_HEADER not in upstream.headers \
                    or waited >= max(2.0, 4 * self.settings.fleet_poll_interval) \
                    or time_left(call.deadline) < 2 * delay:
                return lease, upstream
            await upstream.aclose()
            lease.release()
            log.info("%s: a node's placement was out of date; asking again", call.rt.name)
            await asyncio.sleep(delay)
            waited, delay = waited + delay, delay * 2
            call.rt = call.find()

    # ---- what some routes do before forwarding (``ROUTES``) ---------------------

    async def _ollama_load_idiom(self, call: _Call) -> bool:
        """Ollama's empty request loads the model (``keep_alive: 0``: unloads it)."""
        if not ollama_empty_request(call.path, call.body):
            return False
        await call.out.json(await load_or_unload(call.rt, call.path, call.keep_alive,
                                                 call.deadline))
        return True

    async def _responses_state(self, call: _Call) -> bool:
        """The Responses API's state: ``previous_response_id`` and ``store`` (here, not
        on a node this was forwarded from, which stores it), and ``mcp`` tools (the
        tool loop runs here, over the worker)."""
        if call.sender is not None:
            return False
        store = self.store
        owner = owner_of(call.headers, bool(self.guard.api_keys), False)
        call.body, pending = await store.prepare(call.body, owner)
        call.raw = json.dumps(call.body).encode()
        tools = call.body.get("tools")
        if isinstance(tools, list) and any(isinstance(t, dict) and t.get("type") == "mcp"
                                           for t in tools):
            resp = await respond_with_mcp(self.mcp, call.body, lambda b: _ask_worker(
                call.rt, call.deadline, call.keep_alive, b, call.fwd))
            await store.put(resp, pending)
            await call.out.json(resp)
            return True
        if pending:
            call.relayed = lambda chunks: store.capture_stream(chunks, pending)
            call.answered = lambda content: store.capture(content, pending)
        return False


@dataclass
class _Call:
    """One request to a model route, on its way to a worker."""

    path: str
    body: dict
    raw: bytes
    headers: dict[str, str]
    fwd: dict[str, str]  # the headers the worker gets
    sender: Optional[Signed]  # the node that forwarded it, if one did
    out: _Reply
    rt: ServedModel
    find: Callable[[], ServedModel]  # the model looked up again (placements change)
    keep_alive: Optional[float]
    timeout: float
    deadline: float
    #: the answer on its way back: a stream, then a whole (200) body
    relayed: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]] = lambda chunks: chunks
    answered: Callable[[bytes], Awaitable[None]] = field(default=lambda content: _nothing())


async def _nothing() -> None:
    return None


class _Route(NamedTuple):
    """How a model route differs from forwarding the body to a worker."""

    before: Optional[Callable[[ModelRoutes, _Call], Awaitable[bool]]] = None  # True: answered
    sse: bool = True  # its streams are SSE (kept alive by comments while a model loads)


_OLLAMA = _Route(ModelRoutes._ollama_load_idiom, sse=False)
#: Every model route, and what it does besides forwarding.
ROUTES: dict[str, _Route] = {
    "/v1/chat/completions": _Route(), "/v1/completions": _Route(),
    "/v1/messages": _Route(), "/v1/messages/count_tokens": _Route(),
    "/v1/embeddings": _Route(), "/v1/responses": _Route(ModelRoutes._responses_state),
    "/api/chat": _OLLAMA, "/api/generate": _OLLAMA, "/api/embed": _OLLAMA,
    "/api/embeddings": _OLLAMA,
}
MODEL_ROUTES = frozenset(ROUTES)


def log_refusal(request_id: str, method: str, path: str, model: Optional[str], status: int,
                content: bytes) -> None:
    """One line for each 4xx/5xx the gateway answers, so an operator can see why a client
    failed: request id, route, model, status and the error's message (never a body)."""
    reason = ""
    try:
        err = json.loads(content).get("error")
        reason = err.get("message", "") if isinstance(err, dict) else str(err or "")
    except (ValueError, AttributeError):
        pass
    log.log(logging.ERROR if status >= 500 else logging.WARNING,
            "%s %s %s model=%s -> %d: %s", request_id, method, loggable(path, 120),
            loggable(model, 120) if model else "-", status, loggable(reason, 300))


class _ClientGone(Exception):
    """The client hung up before its request was complete."""


class _Reply:
    """The answer to one request: headers once, the request id, metrics labels."""

    def __init__(self, send: Any, rid: str, path: str, labels: Optional[dict],
                 metrics: Metrics, t0: float):
        self._send, self.request_id, self.path = send, rid, path
        self.labels, self.metrics, self.t0 = labels, metrics, t0
        self.started = False
        self._model = ""
        self.asked: Optional[str] = None  # the model the request named (for the log)
        if labels is not None:
            labels["route"] = path

    @property
    def model(self) -> str:
        return self._model

    @model.setter
    def model(self, name: str) -> None:
        self._model = name
        if self.labels is not None:
            self.labels["model"] = name

    async def _start(self, status: int, ctype: str, extra: list) -> None:
        self.started = True
        self.metrics.answered(self._model, self.path, self.t0)
        await self._send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", ctype.encode("latin-1")),
            (b"x-request-id", self.request_id.encode()), *extra]})

    async def send(self, status: int, ctype: str, content: bytes, extra: list = ()) -> None:
        if status >= 400:
            log_refusal(self.request_id, "POST", self.path, self._model or self.asked, status,
                        content)
        await self._start(status, ctype, [(b"content-length", str(len(content)).encode()),
                                          *extra])
        await self._send({"type": "http.response.body", "body": content})

    async def json(self, obj: Any, status: int = 200, extra: list = ()) -> None:
        await self.send(status, "application/json", json.dumps(obj).encode(), extra)

    async def error(self, err: APIError) -> None:
        if self.started:  # cannot happen: streams report errors in-band
            log.error("POST %s: %s after the answer started", self.path, err.message)
            return
        await self.json(error_body(err, self.path), err.status,
                        [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()])

    async def stream(self, status: int, ctype: str, body: AsyncIterator[bytes],
                     extra: list = ()) -> None:
        body = self.metrics.observe_stream(body, self._model, self.t0)
        await self._start(status, ctype, [*_STREAM_HEADERS, *extra])
        last = b""
        try:
            async for chunk in body:
                last = chunk
                await self._send({"type": "http.response.body", "body": chunk,
                                  "more_body": True})
        except asyncio.CancelledError:
            # A client may hang up as soon as it has the stream's last event (Codex does,
            # after response.completed), before the stream's own end: it got the whole
            # answer, so it is no 499. Only the last chunk is looked at, once.
            if self.labels is not None and any(m in last for m in _FINAL_EVENTS):
                self.labels["complete"] = True
            raise
        finally:
            await body.aclose()  # runs the relay's clean-up if we were cancelled mid-way
        await self._send({"type": "http.response.body", "body": b""})


async def _hang_up(receive: Any, task: asyncio.Task) -> None:
    """Cancel ``task`` when its client disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


async def _ask_worker(rt: ServedModel, deadline: float, keep_alive: Any, body: dict, headers: dict
                      ) -> dict:
    """One non-streaming /v1/responses round on the model's worker (the MCP tool loop)."""
    async with await rt.lease(deadline, keep_alive) as lease:
        upstream = await lease.send("POST", "/v1/responses", json.dumps(body).encode(),
                                    headers)
        try:
            async with until(deadline):
                content = await upstream.aread()
        except (asyncio.TimeoutError, TimeoutError):
            raise timeout_error(lease.name) from None
        finally:
            await upstream.aclose()
    if upstream.status_code != 200:
        raise APIError.answered(upstream.status_code, content, f"model '{rt.name}'")
    return json.loads(content)


def _keep_alive(value: Any) -> float:
    try:
        return parse_duration(value)
    except ValueError as e:
        raise APIError(400, f"Invalid keep_alive: {e}", param="keep_alive",
                       code="invalid_value") from None


class _Watchdog:
    """One timer per stream for "the next chunk is late". A chunk only records when the
    next one is due; the timer moves itself when it fires early. (An ``asyncio.timeout``
    per chunk, a timer armed and cancelled each time, was ~6% of the gateway's CPU at
    32 streams.) It cancels the task only while it waits on the worker (``waiting``),
    never while the task is sending a chunk to the client."""

    def __init__(self, due: float, gap: float) -> None:
        self.due, self.gap, self.waiting, self.fired = due, gap, True, False
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(time_left(due), self._check)

    def _check(self) -> None:
        if not self.waiting:  # sending to the client: the gap starts once that is done
            self._timer = self._loop.call_later(self.gap, self._check)
        elif time.monotonic() < self.due:  # a chunk came since: look again when due
            self._timer = self._loop.call_later(time_left(self.due), self._check)
        elif self._task is not None:
            self.fired = True
            self._task.cancel()

    def chunk_sent(self) -> None:
        """The client took a chunk: the next one is due within ``gap``."""
        self.waiting, self.due = True, time.monotonic() + self.gap

    def timed_out(self) -> bool:
        """After a ``CancelledError``: whether this watchdog caused it (then the task is
        no longer cancelled; otherwise the cancellation is the caller's to pass on)."""
        if self.fired and self._task is not None and hasattr(self._task, "uncancel"):
            self._task.uncancel()  # Python 3.11+; 3.10 tasks keep no count
        return self.fired

    def close(self) -> None:
        self._timer.cancel()


async def _relay(lease: Lease, upstream: Any, path: str, gap: float
                 ) -> AsyncIterator[bytes]:
    """The worker's stream, chunk by chunk. The timeout bounds waiting, not producing:
    the first chunk must come by the request's deadline, each next one within ``gap``
    seconds of the last (an agent's long answer that keeps streaming is not cut; a stream
    that stalls is)."""
    chunks = upstream.aiter_raw()
    watchdog = _Watchdog(lease.deadline, gap)  # (waiting for the first chunk)
    # The Responses API numbers its events from 0, one per event: an error the relay
    # adds takes the next number, so count the events (each ends with a blank line).
    numbered = path == "/v1/responses"
    seq, tail = 0, b""
    try:
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except asyncio.CancelledError:
                if watchdog.timed_out():
                    raise TimeoutError from None
                raise
            watchdog.waiting = False
            if numbered:
                seq += (tail + chunk[:1]).count(b"\n\n") + chunk.count(b"\n\n")
                tail = chunk[-1:]
            yield chunk  # the watchdog never cancels around a yield
            watchdog.chunk_sent()
    except (asyncio.TimeoutError, TimeoutError):
        err = timeout_error(lease.name)
        log.warning("%s: %s", lease.name, err.message)
        yield stream_error(err, path, seq).encode()
    except httpx.TransportError as e:
        log.warning("%s: stream broke: %s", lease.name, e)
        err = APIError(502, f"The worker for model '{lease.name}' failed mid-stream.",
                       type="server_error", code="worker_failed")
        yield stream_error(err, path, seq).encode()
    finally:
        watchdog.close()
        await upstream.aclose()
        lease.release()


async def _stream_after_load(acquire: Awaitable[Lease], name: str, target: tuple,
                             keepalive: float, gap: float) -> AsyncIterator[bytes]:
    """A stream whose model is not loaded yet: keep-alive comments, then the answer."""
    path = target[1]
    load = asyncio.ensure_future(acquire)
    lease = None
    try:
        while True:
            done, _ = await asyncio.wait({load}, timeout=keepalive)
            if done:
                break
            yield f": loading model {name}\n\n".encode()
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
        # a worker's error, re-sent as the last event of a started stream
        err = APIError.answered(upstream.status_code, body, f"model '{lease.name}'")
        yield stream_error(err, path).encode()
        return
    async for chunk in _relay(lease, upstream, path, gap):
        yield chunk


