"""The control API under ``/mlxfleet/v1/``, used by the CLI (kubectl-style)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from quart import Quart, request

from .. import __version__
from ..fleet_tls import JOIN_ROUTE, FleetTLSError, answer_join
from ..names import loggable
from ..units import parse_duration
from ..wire import APIError, streaming_response

if TYPE_CHECKING:
    from ..supervisor.supervisor import Supervisor

log = logging.getLogger("mlxfleet.store")


def _runtime(supervisor: Supervisor, name: str):
    rt = supervisor.get(name) or supervisor.resolve(name)
    if rt is None:
        raise APIError(404, f"No model named '{name}'. Known: "
                       f"{', '.join(supervisor.all_names()) or 'none'}.",
                       type="not_found_error", code="model_not_found")
    return rt


def register_control(app: Quart, supervisor: Supervisor) -> None:
    from ..supervisor.apply import ApplyError, apply_text, delete_model

    base = "/mlxfleet/v1"

    @app.get(f"{base}/info")
    async def info():
        s = supervisor.settings
        return {"version": __version__, "manifestsDir": str(supervisor.manifests_dir),
                "stateDir": str(Path(s.state_dir).expanduser()),
                "logDir": str(supervisor.log_dir), "host": s.host, "port": s.port}

    @app.get(f"{base}/models")
    async def list_models():
        errors = {f: [str(e) for e in errs] for f, errs in supervisor.file_errors.items()}
        return {"items": [rt.status() for rt in supervisor.entries()],
                "manifestErrors": errors, "memory": supervisor.memory_status(),
                "pulls": supervisor.pulls.status()}

    @app.get(f"{base}/node")
    async def node():
        """This node's report to the others of its fleet (the guard asks for the key)."""
        if supervisor.fleet is None:
            raise APIError(404, "This server is not a node of a fleet (start it with --node).",
                           type="not_found_error", code="not_a_node")
        return supervisor.node_report()

    @app.post(JOIN_ROUTE)
    async def join():
        """A new node joins the fleet with a token (``fleet_tls``): answered by the node
        holding the fleet CA, checked by the token's MAC, not by an API key."""
        if supervisor.fleet is None:
            raise APIError(404, "This server is not a node of a fleet (start it with --node).",
                           type="not_found_error", code="not_a_node")
        body = await request.get_json(force=True, silent=True)
        try:
            answer = await asyncio.to_thread(answer_join, supervisor.settings.fleet_folder,
                                             body)
        except FleetTLSError as e:
            log.warning("a join request from %s refused: %s", request.remote_addr, e)
            raise APIError(e.status, f"Join refused: {e}", type="authentication_error"
                           if e.status == 401 else "invalid_request_error",
                           code="join_refused") from None
        log.warning("node %s joined the fleet from %s (token %s)", loggable(body["node"]),
                    request.remote_addr, loggable(body["token"]))
        return answer

    @app.get(f"{base}/nodes")
    async def nodes():
        return {"items": supervisor.nodes_status(), "node": supervisor.node_name}

    @app.post(f"{base}/models/<name>/load")
    async def load(name: str):
        """Load and wait until it serves; ``?keepAlive=`` as a request's keep_alive."""
        rt = _runtime(supervisor, name)
        keep_alive = None
        if "keepAlive" in request.args:
            try:
                keep_alive = parse_duration(request.args["keepAlive"])
            except ValueError as e:
                raise APIError(400, f"Invalid keepAlive: {e}", param="keepAlive") from None
        return await rt.load(time.monotonic() + supervisor.settings.startup_timeout,
                             keep_alive)

    @app.post(f"{base}/models/<name>/unload")
    async def unload(name: str):
        return await _runtime(supervisor, name).unload()

    @app.get(f"{base}/models/<name>")
    async def get_model(name: str):
        return _runtime(supervisor, name).status()

    @app.get(f"{base}/models/<name>/logs")
    async def logs(name: str):
        rt = _runtime(supervisor, name)
        try:
            n = int(request.args.get("tail", "100"))
        except ValueError:
            raise APIError(400, "tail must be an integer", param="tail") from None
        follow = request.args.get("follow", "").lower() in ("1", "true", "yes")
        lines = await rt.logs(n, follow)
        if not follow:
            text = "".join([chunk async for chunk in lines])
            return text, 200, {"Content-Type": "text/plain; charset=utf-8"}
        return streaming_response(lines, content_type="text/plain; charset=utf-8")

    @app.get(f"{base}/sources")
    async def sources():
        """What is on disk, which models use it, and the pulls under way."""
        from ..store import stored
        from .ollama_store import created_root

        items = await asyncio.to_thread(stored, created_root(supervisor.settings.state_dir))
        users: dict[str, list[str]] = {}
        for rt in supervisor.entries():
            users.setdefault(rt.manifest.spec.source, []).append(rt.name)
        return {"items": [s.as_dict(users.get(s.source, [])) for s in items],
                "pulls": supervisor.pulls.status()}

    @app.get(f"{base}/store/listing")
    async def store_listing():
        """For the other nodes of a fleet: what this one holds of a source (peer copy)."""
        from ..store import snapshot_listing

        got = await asyncio.to_thread(snapshot_listing, request.args.get("source", ""),
                                      request.args.get("revision"))
        if got is None:
            raise APIError(404, "This node does not hold that source.", type="not_found_error",
                           code="source_not_found")
        return got

    @app.get(f"{base}/store/file")
    async def store_file():
        """For the other nodes of a fleet: one file of a snapshot, from a byte offset
        (``Range: bytes=N-``), so a copy that broke off continues."""
        import re

        from quart import Response

        from ..store import snapshot_file

        path = await asyncio.to_thread(snapshot_file, request.args.get("source", ""),
                                       request.args.get("commit", ""),
                                       request.args.get("name", ""))
        if path is None:
            raise APIError(404, "This node does not hold that file.", type="not_found_error",
                           code="source_not_found")
        size = path.stat().st_size
        m = re.fullmatch(r"bytes=(\d+)-", request.headers.get("Range", ""))
        start = min(int(m.group(1)), size) if m else 0
        log.info("serving %s %s from byte %d of %d to node %s",
                 loggable(request.args["source"]), loggable(request.args["name"]), start,
                 size, loggable(request.headers.get("X-Mlxfleet-Forwarded-By", "?")))

        async def body():
            with open(path, "rb") as f:
                f.seek(start)
                while chunk := await asyncio.to_thread(f.read, 1 << 20):
                    yield chunk

        headers = {"Content-Length": str(size - start), "Accept-Ranges": "bytes"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        return Response(body(), status=206 if start else 200, headers=headers,
                        content_type="application/octet-stream")

    @app.delete(f"{base}/sources")
    async def remove_source_route():
        from .ollama_store import remove_source

        source = request.args.get("source", "")
        if not source:
            raise APIError(400, "source is required (?source=owner/name)", param="source")
        return {"source": source, "freedBytes": await remove_source(supervisor, source)}

    @app.post(f"{base}/manifests")
    async def apply():
        text = (await request.get_data()).decode("utf-8", errors="replace")
        name = request.args.get("filename", "<apply>")
        try:
            applied = await asyncio.to_thread(apply_text, supervisor.manifests_dir, text, name,
                                                  supervisor.rules)
        except ApplyError as e:
            err = APIError(400, str(e), code="invalid_manifest")
            body = err.body()
            body["error"]["details"] = [str(x) for x in e.errors]
            return body, 400
        await supervisor.reload()
        return {"applied": [a.__dict__ for a in applied]}

    @app.delete(f"{base}/models/<name>")
    async def delete(name: str):
        if supervisor.get(name) is None:
            _runtime(supervisor, name)  # 404 with the known names
        f = await asyncio.to_thread(delete_model, supervisor.manifests_dir, name)
        if f is None:
            raise APIError(404, f"Model '{name}' is running but its manifest is not in "
                           f"{supervisor.manifests_dir}.", code="manifest_not_found")
        await supervisor.reload()
        return {"deleted": name, "file": f}
