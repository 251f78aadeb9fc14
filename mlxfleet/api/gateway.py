"""The gateway: one public port, routing requests to workers by ``model``.

It runs in the supervisor's process and event loop. The model routes are a lean ASGI
app (``model_routes.py``) in front of this Quart app, which serves everything else:
models list, health, status, the control API, Ollama's management routes, stored
responses, MCP and the dashboard.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from quart import Quart

from ..manifest import is_pattern
from ..names import loggable
from ..wire import APIError, install_error_handlers
from .mcp import register_mcp
from .metrics import Metrics
from .model_routes import MODEL_ROUTES, ModelRoutes, log_refusal
from .ollama import register_ollama
from .ollama_store import register_ollama_store
from .responses import ResponseStore, register_responses

if TYPE_CHECKING:
    from ..supervisor.admission import ServedModel
    from ..supervisor.supervisor import Supervisor

log = logging.getLogger("mlxfleet.gateway")


async def _from_node(supervisor: Supervisor, node: str, method: str, rid: str, owner: str
                     ) -> Optional[dict]:
    """Ask the node that stored a response for it (GET) or to delete it (DELETE), on
    behalf of ``owner``; None when it has none for them or does not answer."""
    import httpx

    from .responses import OWNER_HEADER

    fleet = supervisor.fleet
    url = fleet.url(node) if fleet is not None else None
    if url is None:
        return None
    try:
        req = fleet.sign(fleet.client.build_request(
            method, f"{url}/v1/responses/{rid}", timeout=10, headers={OWNER_HEADER: owner}),
            node)
        r = await fleet.client.send(req)
    except httpx.HTTPError:
        return None
    if r.status_code != 200 or not fleet.answer_ok(req, r.status_code, r.content, r.headers):
        return None  # not found, or not an answer of this fleet's
    return r.json()


def create_gateway(supervisor: Supervisor, mcp: Any = None) -> Quart:
    """The public app. ``supervisor`` resolves names and owns the workers."""
    from .control import register_control
    from .dashboard import register_dashboard
    from .guard import Guard, allowed_hosts, install_guard

    settings = supervisor.settings
    app = Quart("mlxfleet.gateway")
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=settings.body_timeout,
                      MAX_CONTENT_LENGTH=settings.max_body_mb << 20)
    install_error_handlers(app)
    def node_hosts() -> list[str]:  # the names the fleet's nodes reach this one by
        fleet = supervisor.fleet
        return [n.host for n in fleet.nodes.values()] if fleet is not None else []

    guard = Guard(settings.api_keys, settings.rate_limit, settings.admin_keys,
                  settings.fleet_key, fleet=bool(settings.node),
                  hosts=allowed_hosts(settings.host, settings.host_names),
                  more_hosts=node_hosts, origins=settings.origin_list,
                  node_tls=supervisor.fleet is not None and supervisor.fleet.tls is not None)
    install_guard(app, guard)
    metrics = Metrics(supervisor)
    store = ResponseStore(Path(settings.state_dir).expanduser() / "responses.sqlite3",
                          settings.responses_store_max, settings.responses_store_mb << 20,
                          settings.responses_ttl, node=settings.node)
    store.remote = lambda node, method, rid, owner: _from_node(supervisor, node, method, rid,
                                                               owner)
    app.asgi_app = ModelRoutes(supervisor, guard, metrics, store, mcp, app.asgi_app)
    metrics.install(app, enabled=settings.enable_metrics)  # counts both
    started = time.time()

    @app.after_request
    async def _log_refusals(response):
        if response.status_code >= 400 and (response.content_length or 1 << 20) < 1 << 16:
            from quart import g, request

            log_refusal(getattr(g, "request_id", "-"), request.method, request.path, None,
                        response.status_code, await response.get_data())
        return response

    @app.route("/api/hello", methods=["GET", "HEAD"])
    async def hello():
        """Claude Code probes ``HEAD /api/hello`` at start to see the server is there: a
        quiet yes (a 404 logged a warning on every start)."""
        return {"status": "ok"}

    @app.get("/v1/status")
    async def status():
        """Every model's engine status (the fields vllm-mlx documents), in one answer."""
        return await metrics.status()

    @app.get("/health")
    async def health():
        names = supervisor.names()
        ready = [n for n in names if supervisor.models[n].ready]
        return {"status": "ok", "models": len(names), "ready": len(ready)}

    def model_entry(rt: ServedModel, name: str) -> dict:
        return {"id": name, "object": "model", "created": int(rt.created or started),
                "owned_by": "mlxfleet", "root": rt.name, "state": rt.phase.value,
                "ready": rt.ready, "aliases": list(rt.manifest.spec.aliases),
                "parsers": (rt.paths or {}).get("parsers"), "node": rt.node}

    @app.get("/v1/models")
    async def models():
        """Every model of the fleet, then each alias as a model of its own (``root``
        names the model it is; glob aliases such as ``claude-*`` are routes, not listed);
        ``node`` says which node runs it (null on a single machine, and for a model no
        node can run)."""
        entries = supervisor.entries()
        data = [model_entry(rt, rt.name) for rt in entries]
        data += [model_entry(rt, a) for rt in entries for a in rt.manifest.spec.aliases
                 if not is_pattern(a)]
        return {"object": "list", "data": data}

    @app.get("/v1/models/<path:model>")
    async def model(model: str):
        """One model by name or alias (what the openai SDK's ``models.retrieve`` asks)."""
        rt = supervisor.resolve(model)
        if rt is None:
            raise APIError(404, f"The model {loggable(model)} does not exist.", param="model",
                           type="invalid_request_error", code="model_not_found")
        return model_entry(rt, model)

    for route in MODEL_ROUTES:  # served by ModelRoutes; Quart answers other methods (405)
        app.add_url_rule(route, endpoint=route, view_func=_served_elsewhere, methods=["POST"])

    register_control(app, supervisor)
    register_ollama(app, supervisor)
    register_ollama_store(app, supervisor)
    register_dashboard(app)
    register_responses(app, store, bool(settings.api_keys))
    register_mcp(app, mcp)
    return app


async def _served_elsewhere() -> None:
    raise AssertionError("model routes are served by ModelRoutes, ahead of Quart")
