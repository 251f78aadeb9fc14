"""``mlxfleet launch CLIENT``: start an agent client pointed at this server, as
``ollama launch`` does: the settings each client needs (its base URL, a key, the model)
are given on its command line or in its environment, never written into the user's own
config files.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

#: What each client calls itself on PATH, how to get it, and the name it asks for when
#: the user names no model (what its requests would send: the bundled manifests alias
#: claude-* and gpt-*); ``pick_model`` turns it into the server's model.
CLIENTS = {
    "claude": ("claude", "npm install -g @anthropic-ai/claude-code", "claude-sonnet"),
    "codex": ("codex", "npm install -g @openai/codex", "gpt-5.5"),
    "opencode": ("opencode", "npm install -g opencode-ai", "gpt-5.5"),
}
#: The smallest context an agent's prompt fits in: Claude Code's first request is ~30k
#: tokens, opencode's ~16k, with room to work.
AGENT_CONTEXT = 32_768


def pick_model(server: str, key: str, asked: str, keep_name: bool = False) -> str:
    """The server's model for a client that would ask for ``asked``: the model that name
    routes to (the bundled ``agents``, through its claude-* and gpt-* aliases; with
    ``keep_name``, ``asked`` itself, which then routes there), else the model with the
    longest context; ``asked`` itself when the server does not answer.
    A model whose context cannot hold an agent's prompt is passed over (the bundled
    demo's 1,024 tokens failed opencode's first request)."""
    import httpx

    try:
        with httpx.Client(base_url=server, timeout=5,
                          headers={"Authorization": f"Bearer {key}"}) as c:
            def context(name: str) -> int:
                r = c.post("/api/show", json={"model": name})
                info = (r.json().get("model_info") or {}) if r.status_code == 200 else {}
                return max([v for k, v in info.items() if k.endswith(".context_length")
                            and isinstance(v, int)] or [0])

            routed = c.get(f"/v1/models/{asked}")
            root = routed.json().get("root") if routed.status_code == 200 else None
            if root and context(root) >= AGENT_CONTEXT:
                return asked if keep_name else root
            models = [m["id"] for m in c.get("/v1/models").json()["data"]
                      if m["id"] == m.get("root")]
            fits = sorted(((context(m), m) for m in models), reverse=True)
            if fits and fits[0][0] >= AGENT_CONTEXT:
                return fits[0][1]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    return asked


@dataclass
class Launch:
    """The client's command line and the environment it needs (on top of the caller's)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # path -> text, written first

    def shell(self) -> str:
        """The same, as lines a person can paste into a shell."""
        lines = [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        lines += [f"cat > {shlex.quote(p)} <<'EOF'\n{t}\nEOF" for p, t in self.files.items()]
        return "\n".join(lines + [shlex.join(self.argv)])


def plan(client: str, server: str, key: str, model: Optional[str], extra: list[str],
         config_dir: Path) -> Launch:
    """What to run for ``client`` against the gateway at ``server``."""
    exe, _, asks = CLIENTS[client]
    key = key or "unused"
    # Codex picks its tools by the model's name (apply_patch only for names it knows):
    # it keeps sending its own, which the server routes
    model = model or pick_model(server, key, asks, keep_name=client == "codex")
    if client == "claude":
        # The server's own model name (Claude Code calls an old claude-* name "retired" on
        # every run); its side requests (Haiku's) go to the same model.
        return Launch([exe, "--model", model, *extra],
                      {"ANTHROPIC_BASE_URL": server, "ANTHROPIC_API_KEY": key,
                       "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
                       "ANTHROPIC_SMALL_FAST_MODEL": model})
    if client == "codex":
        provider = (f'model_providers.mlxfleet={{name="mlxfleet", base_url="{server}/v1", '
                    'wire_api="responses", env_key="MLXFLEET_CLIENT_KEY"}')
        return Launch([exe, "-c", "model_provider=mlxfleet", "-c", provider, "-m", model,
                       *extra], {"MLXFLEET_CLIENT_KEY": key})
    config = config_dir / "opencode.json"
    text = json.dumps({
        "$schema": "https://opencode.ai/config.json", "model": f"mlxfleet/{model}",
        "provider": {"mlxfleet": {
            "npm": "@ai-sdk/openai-compatible", "name": "mlxfleet",
            "options": {"baseURL": f"{server}/v1", "apiKey": key},
            "models": {model: {"name": model, "tool_call": True}}}}}, indent=2)
    return Launch([exe, *extra], {"OPENCODE_CONFIG": str(config)}, {str(config): text})


def run(launch: Launch) -> int:
    """Write the files, then replace this process with the client."""
    exe = shutil.which(launch.argv[0])
    if exe is None:
        how = next(h for name, h, _ in CLIENTS.values() if name == launch.argv[0])
        raise SystemExit(f"error: {launch.argv[0]} is not on PATH; install it with: {how}")
    for path, text in launch.files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    os.execvpe(exe, launch.argv, {**os.environ, **launch.env})
    return 0  # not reached
