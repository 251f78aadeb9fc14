"""Prometheus metrics and the aggregated ``/v1/status`` for the gateway.

Gateway metrics are recorded as requests pass; model and engine metrics are
read at scrape time from the supervisor and from every loaded worker's
``/v1/status`` (a custom collector), so a worker restart simply resets its
counters, which Prometheus handles.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from quart import Quart, Response, g, request

from ..names import loggable
from .guard import OPEN_ROUTES

if TYPE_CHECKING:
    from ..supervisor.supervisor import Supervisor

log = logging.getLogger("mlxfleet.gateway")
SCOPE_KEY = "mlxfleet.request"  # the request's metrics labels, in the ASGI scope

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, supervisor: Supervisor):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.started = time.time()
        self.sup = supervisor
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxfleet_requests_total", "Requests answered by the gateway",
                                ["model", "route", "status"], registry=r)
        self.latency = Histogram("mlxfleet_request_duration_seconds",
                                 "Time to the response headers", ["model", "route"],
                                 buckets=_BUCKETS, registry=r)
        self.ttft = Histogram("mlxfleet_time_to_first_token_seconds",
                              "Streaming: time to the first chunk", ["model"],
                              buckets=_BUCKETS, registry=r)
        self.stream_seconds = Histogram("mlxfleet_stream_duration_seconds",
                                        "Streaming: time to the last chunk", ["model"],
                                        buckets=_BUCKETS, registry=r)
        self.inflight = Gauge("mlxfleet_inflight_requests", "Requests being served",
                              registry=r)
        self._workers: dict[str, dict] = {}
        r.register(_ModelCollector(self))

    def install(self, app: Quart, enabled: bool) -> None:
        inner = app.asgi_app

        async def counted(scope, receive, send):
            """Counts every request from its first byte to its last, however it ends: a
            client that hangs up before the answer is complete counts as 499."""
            if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
                return await inner(scope, receive, send)
            state: dict[str, Any] = {"status": None, "done": False}
            scope[SCOPE_KEY] = state

            async def watch(message):
                if message["type"] == "http.response.start":
                    state["status"] = message["status"]
                elif message["type"] == "http.response.body" and not message.get("more_body"):
                    state["done"] = True
                await send(message)

            self.inflight.inc()
            try:
                await inner(scope, receive, watch)
            finally:
                self.inflight.dec()
                status = state["status"] if state["done"] or state.get("complete") else 499
                model = state.get("model", "")
                route = state.get("route", UNMATCHED)
                if status == 499:
                    log.info("%s %s%s: client disconnected (499)", scope["method"],
                             loggable(scope["path"], 120),
                             f" (model {loggable(model, 120)})" if model else "")
                self.requests.labels(model, route, str(status)).inc()

        app.asgi_app = counted

        @app.before_request
        async def _route():
            state = request.scope.get(SCOPE_KEY)
            if state is not None:  # label by route template: paths are unbounded
                state["route"] = route_label()

        @app.after_request
        async def _done(response: Response):
            started = getattr(g, "started", None)
            if started is not None and request.path not in OPEN_ROUTES:
                self.answered(getattr(g, "model", "") or "", route_label(), started)
            return response

        if enabled:
            @app.get("/metrics")
            async def metrics():
                from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

                await self.refresh()
                return Response(generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)

    def answered(self, model: str, route: str, t0: float) -> None:
        """The response headers of a request that arrived at ``t0`` are going out."""
        self.latency.labels(model, route).observe(time.perf_counter() - t0)

    def observe_stream(self, body: AsyncIterator[bytes], model: str,
                       t0: float) -> AsyncIterator[bytes]:
        """Wrap a streamed body to time its first and last chunks from ``t0``, the
        request's arrival (``time.perf_counter()``)."""

        async def timed():
            first = True
            try:
                async for chunk in body:
                    if first:
                        self.ttft.labels(model).observe(time.perf_counter() - t0)
                        first = False
                    yield chunk
            finally:
                self.stream_seconds.labels(model).observe(time.perf_counter() - t0)

        return timed()

    async def _worker_status(self, name: str) -> tuple[str, dict | None]:
        rt = self.sup.models.get(name)
        return name, (await rt.worker_status() if rt is not None else None)

    async def refresh(self) -> dict[str, dict]:
        results = await asyncio.gather(*(self._worker_status(n) for n in self.sup.names()))
        self._workers = {n: s for n, s in results if s is not None}
        return self._workers

    async def status(self) -> dict[str, Any]:
        workers = await self.refresh()
        models = {}
        for n in self.sup.names():
            rt = self.sup.models[n]
            entry = {"phase": rt.phase.value, "ready": rt.ready, "inflight": rt.inflight,
                     "waiting_for_load": rt.waiters}
            if n in workers:
                entry.update(workers[n])
            models[n] = entry
        from ..accelerator import this_node

        return {**aggregate_status(models, time.time() - self.started),
                "models": models, "memory": self.sup.memory_status(),
                "accelerator": this_node().as_dict()}


def aggregate_status(models: dict[str, dict], uptime: float) -> dict[str, Any]:
    """The whole server in vllm-mlx's ``/v1/status`` shape: counters summed over the
    loaded models, ``model`` the one name (or the list), every in-flight request."""
    loaded = {n: m for n, m in models.items() if "steps_executed" in m}
    out: dict[str, Any] = {
        "status": "running" if loaded else "not_loaded",
        "model": next(iter(models)) if len(models) == 1 else sorted(models),
        "uptime_s": round(uptime, 3)}
    for key in ("steps_executed", "num_running", "num_waiting", "total_requests_processed",
                "total_prompt_tokens", "total_completion_tokens"):
        out[key] = sum(m.get(key, 0) for m in loaded.values())
    out["metal"] = {k: round(sum(m["metal"][k] for m in loaded.values()), 3)
                    for k in ("active_memory_gb", "peak_memory_gb", "cache_memory_gb")}
    entries = sum(m["cache"]["entries"] for m in loaded.values())
    hits = looked = 0
    for m in loaded.values():
        pc = m.get("prompt_cache") or {}
        h = sum((pc.get("hits") or {}).values())
        hits, looked = hits + h, looked + h + pc.get("misses", 0)
    kinds = sorted({m["cache"]["type"] for m in loaded.values()})
    out["cache"] = {"type": kinds[0] if len(kinds) == 1 else "mixed", "entries": entries,
                    "hit_rate": round(hits / looked, 4) if looked else 0.0,
                    "memory_mb": round(sum(m["cache"]["memory_mb"] for m in loaded.values()), 1)}
    out["requests"] = [{**r, "model": n} for n, m in loaded.items()
                       for r in m.get("requests", [])]
    return out


UNMATCHED = "<unmatched>"


def route_label() -> str:
    """The route template (``/mlxfleet/v1/models/<name>``), or one label for unknown paths."""
    rule = request.url_rule
    return rule.rule if rule is not None else UNMATCHED


class _ModelCollector:
    """Model state from the supervisor, engine counters from the workers."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sup = self.m.sup
        state = GaugeMetricFamily("mlxfleet_model_state", "1 for the model's current phase",
                                  labels=["model", "phase"])
        loaded = GaugeMetricFamily("mlxfleet_model_loaded", "1 if loaded", labels=["model"])
        mem = GaugeMetricFamily("mlxfleet_model_memory_bytes", "Worker resident memory",
                                labels=["model"])
        queue = GaugeMetricFamily("mlxfleet_model_queue_depth",
                                  "Requests waiting (for a load or a batch slot)",
                                  labels=["model"])
        inflight = GaugeMetricFamily("mlxfleet_model_inflight_requests",
                                     "Requests running on the model", labels=["model"])
        events = {k: CounterMetricFamily(f"mlxfleet_model_{k}", f"Model {k}", labels=["model"])
                  for k in ("loads", "unloads", "evictions", "restarts")}
        for n in sup.names():
            rt = sup.models[n]
            state.add_metric([n, rt.phase.value], 1)
            loaded.add_metric([n], 1 if rt.ready else 0)
            mem.add_metric([n], rt.measured_bytes or 0)
            inflight.add_metric([n], rt.inflight)
            w = self.m._workers.get(n) or {}
            queue.add_metric([n], rt.waiters + (w.get("num_waiting") or 0))
            for k, fam in events.items():
                fam.add_metric([n], getattr(rt, k, 0))
        yield from (state, loaded, mem, queue, inflight, *events.values())
        yield from self._engine()

    def _engine(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g_running = GaugeMetricFamily("mlxfleet_engine_batch_size", "Sequences in the batch",
                                      labels=["model"])
        g_waiting = GaugeMetricFamily("mlxfleet_engine_waiting", "Sequences not yet started",
                                      labels=["model"])
        c = {k: CounterMetricFamily(f"mlxfleet_engine_{k}", k.replace("_", " "),
                                    labels=["model"])
             for k in ("steps", "prompt_tokens", "completion_tokens", "requests")}
        cache_entries = GaugeMetricFamily("mlxfleet_prompt_cache_entries", "Retained caches",
                                          labels=["model"])
        cache_bytes = GaugeMetricFamily("mlxfleet_prompt_cache_bytes", "Retained cache bytes",
                                        labels=["model"])
        hits = CounterMetricFamily("mlxfleet_prompt_cache_hits", "Prompt cache hits",
                                   labels=["model", "kind"])
        misses = CounterMetricFamily("mlxfleet_prompt_cache_misses", "Prompt cache misses",
                                     labels=["model"])
        evict = CounterMetricFamily("mlxfleet_prompt_cache_evictions", "Evicted cache entries",
                                    labels=["model"])
        for n, s in self.m._workers.items():
            if "steps_executed" not in s:
                continue
            g_running.add_metric([n], s["num_running"])
            g_waiting.add_metric([n], s["num_waiting"])
            c["steps"].add_metric([n], s["steps_executed"])
            c["prompt_tokens"].add_metric([n], s["prompt_tokens_total"])
            c["completion_tokens"].add_metric([n], s["generation_tokens_total"])
            c["requests"].add_metric([n], s["requests_total"])
            pc = s.get("prompt_cache") or {}
            if pc:
                cache_entries.add_metric([n], pc["entries"])
                cache_bytes.add_metric([n], pc["bytes"])
                for kind, v in pc["hits"].items():
                    hits.add_metric([n, kind], v)
                misses.add_metric([n], pc["misses"])
                evict.add_metric([n], pc["evictions"])
        yield from (g_running, g_waiting, *c.values(), cache_entries, cache_bytes, hits, misses,
                    evict)
