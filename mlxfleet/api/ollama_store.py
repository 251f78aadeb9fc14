"""Ollama's routes for models on disk: ``/api/pull`` (streamed progress), ``/api/delete``,
``/api/copy`` (an alias), ``/api/create`` (from a local checkpoint, quantized with
mlx-lm's converter) and ``/api/push`` (not here: 501).

Every one changes the machine, so the guard asks for the admin key when keys are set
(with no key, only clients on this machine). Names are those clients send: a model of
the manifests folder (its source is pulled), else a source itself (a Hugging Face repo
id, ``NAME:latest`` meaning NAME).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from quart import Quart, request

from .. import names
from ..sources import source_kind
from ..store import PullError
from ..wire import APIError, parse_json_body, streaming_response

if TYPE_CHECKING:
    from ..supervisor.supervisor import Supervisor

#: Fields of /api/create this server acts on; any other is refused, never ignored.
_CREATE_FIELDS = {"model", "name", "from", "quantize", "stream"}


def _named(body: dict, key: str = "model") -> str:
    name = body.get(key) or (body.get("name") if key == "model" else None)
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{key} is required", param=key)
    return name  # as sent: "evil\n" is not "evil"


def _new_model_name(body: dict, key: str = "model") -> str:
    """A name that becomes a manifest (and a file, and a folder): checked before any
    path is built from it (Ollama's ``NAME:latest`` is ``NAME``)."""
    name = _named(body, key)
    name = name[:-len(":latest")] if name.endswith(":latest") else name
    try:
        return names.model_name(name)
    except ValueError as e:
        raise APIError(400, f"{key}: {e}", param=key, code="invalid_name") from None


def source_of(supervisor: Supervisor, name: str) -> tuple[str, Optional[str]]:
    """(source, revision) for a name a client sent: a model's, or the name itself."""
    rt = supervisor.resolve(name)
    if rt is not None:
        return rt.manifest.spec.source, rt.manifest.spec.revision
    source = name[:-len(":latest")] if name.endswith(":latest") else name
    if source_kind(source) == "hf" and source.count("/") != 1:
        raise APIError(404, f"model '{name}' not found: it is neither a model of this server "
                       "nor a Hugging Face repo id (owner/name, e.g. "
                       "mlx-community/Qwen3-0.6B-4bit)", code="model_not_found")
    return source, None


def _ndjson(events: Any) -> Any:
    async def lines():
        async for e in events:
            yield json.dumps(e) + "\n"
    return streaming_response(lines(), content_type="application/x-ndjson")


def register_ollama_store(app: Quart, supervisor: Supervisor) -> None:
    pulls = supervisor.pulls

    @app.post("/api/pull")
    async def ollama_pull():
        body = parse_json_body(await request.get_data())
        source, revision = source_of(supervisor, _named(body))
        p = pulls.start(source, revision)
        await p.listed.wait()  # a repo that is not there is a 404, not a started stream
        if p.error is not None:
            raise APIError(p.error.status, str(p.error), code="pull_failed")
        if body.get("stream") is False:
            try:
                await p.wait()
            except PullError as e:
                raise APIError(e.status, str(e), code="pull_failed") from None
            return {"status": "success"}

        async def events():
            async for e in p.events():
                yield e
            if p.error is not None:  # Ollama's clients raise on an "error" line
                yield {"error": str(p.error)}
        return _ndjson(events())

    @app.delete("/api/delete")
    async def ollama_delete():
        body = parse_json_body(await request.get_data())
        name = _named(body)
        await remove_source(supervisor, source_of(supervisor, name)[0], name)
        return {}

    @app.post("/api/copy")
    async def ollama_copy():
        """``destination`` becomes an alias of the model ``source`` (its manifest gains
        it); a source that is no model here gets a manifest of its own by that name. A
        destination that already names a model is refused unless ``force`` is true
        (Ollama overwrites; a manifest is a person's file, so here it takes asking)."""
        body = parse_json_body(await request.get_data())
        src, dest = _named(body, "source"), _named(body, "destination")
        rt = supervisor.resolve(src)
        # exact names and aliases only: an exact alias wins over a glob (claude-*)
        taken = dest if dest in supervisor.all_names() else supervisor.aliases.get(dest)
        if taken is not None and not (body.get("force") is True and taken == dest):
            raise APIError(409, f"{names.loggable(dest)} already names model "
                           f"'{taken}'; send \"force\": true to replace a model's "
                           "manifest (an alias of another model is never replaced)",
                           param="destination", code="model_exists")
        if rt is not None and taken is None:
            try:
                names.alias(dest)
            except ValueError as e:
                raise APIError(400, f"destination: {e}", param="destination",
                               code="invalid_name") from None
            spec = rt.manifest.spec
            m = rt.manifest.model_copy(update={"spec": spec.model_copy(
                update={"aliases": [*spec.aliases, dest]})})
        else:  # a manifest of its own, with the source's weights
            m = _manifest(_new_model_name(body, "destination"), *source_of(supervisor, src))
        await _apply(supervisor, m)
        return {}

    @app.post("/api/create")
    async def ollama_create():
        body = parse_json_body(await request.get_data())
        name = _new_model_name(body)
        extra = sorted(set(body) - _CREATE_FIELDS)
        if extra:
            raise APIError(400, f"/api/create here takes {', '.join(sorted(_CREATE_FIELDS))}; "
                           f"not {', '.join(extra)} (a model's settings go in its manifest)",
                           param=extra[0])
        origin = body.get("from")
        if not isinstance(origin, str) or not origin:
            raise APIError(400, "from is required: a model directory, a Hugging Face repo id "
                           "or a model of this server", param="from")
        source, revision = source_of(supervisor, origin)
        quantize = body.get("quantize")
        bits = _bits(quantize) if quantize is not None else None

        async def events():
            yield {"status": "pulling manifest"}
            if source_kind(source) == "hf":
                async for e in pulls.start(source, revision).events():
                    if e["status"] not in ("pulling manifest", "success"):
                        yield e
            if bits is not None:
                yield {"status": f"quantizing to {bits} bits"}
            try:
                made, rev = source, revision
                if bits is not None:
                    out = created_dir(supervisor.settings.state_dir, name)
                    await asyncio.to_thread(_convert, source, revision, out, bits)
                    made, rev = str(out), None
                yield {"status": "writing manifest"}
                await _apply(supervisor, _manifest(name, made, rev))
            except (PullError, APIError, ValueError, OSError) as e:
                yield {"error": getattr(e, "message", None) or str(e)}
                return
            yield {"status": "success"}

        if body.get("stream") is False:
            last: dict = {}
            async for e in events():
                last = e
            if "error" in last:
                raise APIError(400, last["error"], code="create_failed")
            return {"status": "success"}
        return _ndjson(events())

    @app.post("/api/push")
    async def ollama_push():
        raise APIError(501, "mlxfleet does not push models to a registry: upload the "
                       "checkpoint with `hf upload` (huggingface_hub) instead.",
                       type="server_error", code="not_implemented")


async def remove_source(supervisor: Supervisor, source: str, asked: Optional[str] = None) -> int:
    """Delete a stored source (the bytes freed): 409 while a loaded model uses it, 404
    when it is not on disk."""
    from ..store import remove

    users = [n for n in supervisor.memory_status()["loaded"]
             if supervisor.models[n].manifest.spec.source == source]
    if users:
        raise APIError(409, f"'{source}' is in use by {', '.join(users)}; unload first "
                       "(a manifest that names it pulls it again when it loads)",
                       code="source_in_use")
    freed = await asyncio.to_thread(remove, source,
                                    created_root(supervisor.settings.state_dir))
    if freed is None:
        raise APIError(404, f"model '{asked or source}' not found", type="not_found_error",
                       code="model_not_found")
    return freed


def _manifest(name: str, source: str, revision: Optional[str] = None) -> Any:
    from ..manifest import Manifest

    spec = {"source": source, **({"revision": revision} if revision else {})}
    try:
        return Manifest.model_validate({"apiVersion": "mlxfleet/v1", "kind": "Model",
                                        "metadata": {"name": name}, "spec": spec})
    except ValueError as e:
        raise APIError(400, f"cannot make a model named {names.loggable(name)}: {e}",
                       code="invalid_manifest") from None


async def _apply(supervisor: Supervisor, manifest: Any) -> None:
    """Write ``manifest`` into the manifests folder (as ``mlxfleet apply`` does) and
    reconcile now, so the model is there when the answer is."""
    from ..manifest import dump_manifest
    from ..supervisor.apply import ApplyError, apply_text

    try:
        await asyncio.to_thread(apply_text, supervisor.manifests_dir, dump_manifest(manifest),
                                f"{manifest.name}.yaml", supervisor.rules)
    except ApplyError as e:
        raise APIError(400, str(e), code="invalid_manifest") from None
    await supervisor.reload()


def _convert(source: str, revision: Optional[str], out: Path, bits: int) -> None:
    """mlx-lm's converter: the checkpoint at ``source``, quantized, written to ``out``."""
    import shutil

    from mlx_lm import convert

    from ..sources import resolve_source

    src = resolve_source(source, revision)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    convert(hf_path=str(src), mlx_path=str(out), quantize=True, q_bits=bits)


def _bits(quantize: Any) -> int:
    """Ollama's quantization names (q4_K_M, q8_0, ...) or a plain 2-8: MLX's bits."""
    text = str(quantize).lower().lstrip("q")
    digits = text.split("_", 1)[0]
    if digits.isdigit() and int(digits) in (2, 3, 4, 5, 6, 8):
        return int(digits)
    raise APIError(400, f"quantize {quantize!r} is not one MLX can write: use q2, q3, q4, q5, "
                   "q6 or q8 (q4_K_M and q8_0 are read as q4 and q8)", param="quantize")


def created_root(state_dir: str) -> Path:
    """Where /api/create writes converted checkpoints, one folder per model."""
    return Path(state_dir).expanduser() / "models"


def created_dir(state_dir: str, name: str) -> Path:
    return created_root(state_dir) / name
