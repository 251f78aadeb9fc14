"""Ollama's native API, the gateway's half: the routes about models rather than tokens
(``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/version``, ``GET``/``HEAD /``) and
Ollama's idiom of loading or unloading a model with an empty chat or generate request.
Generation itself (``/api/chat``, ``/api/generate``, ``/api/embed``) is forwarded to
the model's worker like every other model route (``worker/ollama.py`` formats it).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING, Any, Optional

from quart import Quart, request

from ..formats import pick_parsers
from ..manifest import is_pattern
from ..wire import APIError, ollama_done, ollama_time, parse_json_body

if TYPE_CHECKING:
    from ..supervisor.admission import ServedModel
    from ..supervisor.supervisor import Supervisor

#: What /api/version reports: the Ollama API level these routes follow (clients compare
#: it to enable features), not mlxfleet's own version.
OLLAMA_VERSION = "0.12.0"
FOREVER = "9999-12-31T23:59:59Z"  # expires_at of a model kept loaded forever


def _digest(rt: ServedModel) -> str:
    return hashlib.sha256(rt.manifest.worker_hash().encode()).hexdigest()


def _details(rt: ServedModel) -> dict[str, Any]:
    cfg = _config(rt)
    family = cfg.get("model_type") or "unknown"
    q = cfg.get("quantization") or cfg.get("quantization_config") or {}
    bits = q.get("bits") if isinstance(q, dict) else None
    return {"parent_model": "", "format": "safetensors", "family": family,
            "families": [family], "parameter_size": _param_size(rt),
            "quantization_level": f"Q{bits}" if bits else "F16"}


def _param_size(rt: ServedModel) -> str:
    """Parameters, estimated from the weights' bytes (Ollama shows e.g. "8.0B")."""
    n = (rt.weight_bytes or 0) / 2  # 16-bit weights; quantized models are underestimated
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{int(n)}"


def _config(rt: ServedModel) -> dict[str, Any]:
    """The model's config.json if it is on disk (never downloads)."""
    from ..sources import local_dir

    d = local_dir(rt.manifest.spec.source, rt.manifest.spec.revision)
    try:
        return json.loads((d / "config.json").read_text()) if d else {}
    except (OSError, ValueError):
        return {}


def _context_length(rt: ServedModel, cfg: dict[str, Any]) -> Optional[int]:
    """The manifest's ``limits.contextLength``, else the checkpoint config's."""
    from ..sources import config_context_length

    return rt.manifest.spec.limits.context_length or config_context_length(cfg)


def _entry(rt: ServedModel, name: str) -> dict[str, Any]:
    return {"name": name, "model": name, "modified_at": ollama_time(rt.created),
            "size": rt.weight_bytes or 0, "digest": _digest(rt), "details": _details(rt)}


def _tagged(name: str) -> str:
    """Ollama's clients list and match models as ``name:tag`` (``:latest`` when the
    name has none); requests for ``NAME:latest`` resolve to NAME."""
    return name if ":" in name else f"{name}:latest"


def register_ollama(app: Quart, supervisor: Supervisor) -> None:
    @app.get("/api/version")
    async def version():
        return {"version": OLLAMA_VERSION}

    @app.get("/api/tags")
    async def tags():
        models = []
        for rt in supervisor.entries():  # the whole fleet
            for name in (rt.name, *rt.manifest.spec.aliases):
                if not is_pattern(name):  # claude-* is a route, not a model to list
                    models.append(_entry(rt, _tagged(name)))
        return {"models": models}

    @app.get("/api/ps")
    async def ps():
        models = []
        for n in supervisor.names():
            rt = supervisor.models[n]
            if not rt.ready:
                continue
            st = rt.status()
            expires = FOREVER if math.isinf(rt.keep_alive) else (st["expiresAt"] or ollama_time())
            resident = rt.memory_bytes() or rt.footprint()
            models.append({**_entry(rt, _tagged(n)), "expires_at": expires, "size": rt.footprint(),
                           "size_vram": resident,
                           "context_length": _context_length(rt, _config(rt))})
        return {"models": models}

    @app.post("/api/show")
    async def show():
        body = parse_json_body(await request.get_data())
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "model is required", param="model")
        rt = supervisor.resolve(name)
        if rt is None:
            raise APIError(404, f"model '{name}' not found", code="model_not_found")
        cfg = _config(rt)
        template = _chat_template(rt)
        d = rt.manifest.spec.defaults
        params = [f"{k} {v}" for k, v in (("temperature", d.temperature), ("top_p", d.top_p),
                                           ("top_k", d.top_k), ("num_predict", d.max_tokens))
                  if v is not None]
        arch = cfg.get("model_type") or "unknown"
        info = {"general.architecture": arch, "general.parameter_count":
                int((rt.weight_bytes or 0) / 2)}
        ctx = _context_length(rt, cfg)
        if ctx:
            info[f"{arch}.context_length"] = ctx
        caps = ["embedding"] if rt.manifest.spec.task == "embedding" else ["completion"]
        if template and "tools" in template:
            caps.append("tools")
        if rt.manifest.spec.parsers.reasoning or (template and "<think>" in template):
            caps.append("thinking")
        if "vision_config" in cfg or rt.manifest.spec.task == "vision":
            caps.append("vision")
        parsers = pick_parsers(cfg.get("model_type"), template,
                               rt.manifest.spec.parsers.tool_call,
                               rt.manifest.spec.parsers.reasoning)
        return {"modelfile": f"# mlxfleet manifest {rt.file}\nFROM {rt.manifest.spec.source}\n",
                "parameters": "\n".join(params), "template": template or "",
                "parsers": parsers.as_dict(),
                "details": _details(rt), "model_info": info, "capabilities": caps,
                "modified_at": ollama_time(rt.created)}


def _chat_template(rt: ServedModel) -> Optional[str]:
    from ..sources import local_dir

    d = local_dir(rt.manifest.spec.source, rt.manifest.spec.revision)
    if d is None:
        return None
    for f in ("chat_template.jinja", "tokenizer_config.json"):
        p = d / f
        if not p.is_file():
            continue
        try:
            text = p.read_text()
            if f.endswith(".json"):
                t = json.loads(text).get("chat_template")
                return t if isinstance(t, str) else None
            return text
        except (OSError, ValueError):
            return None
    return None


async def load_or_unload(rt: ServedModel, path: str, keep_alive: Optional[float],
                         deadline: float) -> dict:
    """Ollama's empty request (``wire.ollama_empty_request``) loads the model, or with
    ``keep_alive: 0`` unloads it (with API keys only for admin keys, which the gateway
    checked), wherever it runs."""
    if keep_alive == 0:
        await rt.unload("unloaded by a request with keep_alive 0")
        return ollama_done(rt.name, path, "unload")
    await rt.load(deadline, keep_alive)
    return ollama_done(rt.name, path, "load")
