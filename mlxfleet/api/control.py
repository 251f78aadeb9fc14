"""The control API under ``/mlxfleet/v1/``, used by the CLI (kubectl-style)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from quart import Quart, request

from .. import __version__
from ..wire import APIError, streaming_response


def _runtime(supervisor: Any, name: str):
    rt = supervisor.get(name) or supervisor.resolve(name)
    if rt is None:
        raise APIError(404, f"No model named '{name}'. Known: "
                       f"{', '.join(supervisor.all_names()) or 'none'}.",
                       type="not_found_error", code="model_not_found")
    return rt


async def _on_node(supervisor: Any, rt: Any, method: str, path: str):
    """Ask the node that runs a remote model (load, unload, describe, logs, followed logs
    too), as if the client had asked it: its answer, status and all, relayed as it comes."""
    import httpx

    rt.check()
    fleet = supervisor.fleet
    req = fleet.client.build_request(
        method, fleet.url(rt.node) + "/mlxfleet/v1" + path, headers=fleet.headers(),
        params=dict(request.args),
        timeout=httpx.Timeout(supervisor.settings.startup_timeout, connect=5))
    try:
        r = await fleet.client.send(req, stream=True)
    except httpx.HTTPError as e:
        raise APIError(503, f"Node '{rt.node}' does not answer: {e or type(e).__name__}",
                       code="node_unreachable") from None

    async def relay():
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            pass  # the node went away mid-answer: end it here
        finally:
            await r.aclose()

    return streaming_response(relay(), status=r.status_code,
                              content_type=r.headers.get("content-type", "application/json"))


def tail_lines(path: Path, n: int) -> list[str]:
    """The last ``n`` lines of a file, reading backwards in blocks."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            pos, data = f.tell(), b""
            while pos > 0 and data.count(b"\n") <= n:
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except FileNotFoundError:
        return []
    return [ln.decode(errors="replace") for ln in data.splitlines()[-n:]] if n else []


def register_control(app: Quart, supervisor: Any) -> None:
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
                "manifestErrors": errors, "memory": supervisor.memory_status()}

    @app.get(f"{base}/node")
    async def node():
        """This node's report to the others of its fleet (the guard asks for the key)."""
        if supervisor.fleet is None:
            raise APIError(404, "This server is not a node of a fleet (start it with --node).",
                           type="not_found_error", code="not_a_node")
        return supervisor.node_report()

    @app.get(f"{base}/nodes")
    async def nodes():
        return {"items": supervisor.nodes_status(), "node": supervisor.node_name}

    @app.post(f"{base}/models/<name>/load")
    async def load(name: str):
        rt = _runtime(supervisor, name)
        if rt.remote:
            return await _on_node(supervisor, rt, "POST", f"/models/{rt.name}/load")
        await supervisor.ready(rt, time.monotonic() + supervisor.settings.startup_timeout)
        return rt.status()

    @app.post(f"{base}/models/<name>/unload")
    async def unload(name: str):
        rt = _runtime(supervisor, name)
        if rt.remote:
            return await _on_node(supervisor, rt, "POST", f"/models/{rt.name}/unload")
        await supervisor.unload(rt)
        return rt.status()

    @app.get(f"{base}/models/<name>")
    async def get_model(name: str):
        return _runtime(supervisor, name).status()

    @app.get(f"{base}/models/<name>/logs")
    async def logs(name: str):
        rt = _runtime(supervisor, name)
        if rt.remote:
            return await _on_node(supervisor, rt, "GET", f"/models/{rt.name}/logs")
        try:
            n = int(request.args.get("tail", "100"))
        except ValueError:
            raise APIError(400, "tail must be an integer", param="tail") from None
        follow = request.args.get("follow", "").lower() in ("1", "true", "yes")
        path = supervisor.log_path(rt.name)
        head = "".join(ln + "\n" for ln in tail_lines(path, max(n, 0)))
        if not follow:
            return head, 200, {"Content-Type": "text/plain; charset=utf-8"}

        async def stream():
            yield head
            pos = path.stat().st_size if path.exists() else 0
            while True:
                await asyncio.sleep(0.3)
                size = path.stat().st_size if path.exists() else 0
                if size < pos:  # rotated
                    pos = 0
                if size > pos:
                    with open(path, "rb") as f:
                        f.seek(pos)
                        chunk = f.read(size - pos)
                    pos = size
                    yield chunk.decode(errors="replace")

        return streaming_response(stream(), content_type="text/plain; charset=utf-8")

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
