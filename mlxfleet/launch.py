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

#: What each client calls itself on PATH, how to get it, and the model name it sends when
#: none is given (the bundled manifests alias these names).
CLIENTS = {
    "claude": ("claude", "npm install -g @anthropic-ai/claude-code", "claude-sonnet-4-5"),
    "codex": ("codex", "npm install -g @openai/codex", "gpt-5.5"),
    "opencode": ("opencode", "npm install -g opencode-ai", "default"),
}


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
    exe, _, default_model = CLIENTS[client]
    model = model or default_model
    key = key or "unused"
    if client == "claude":
        return Launch([exe, "--model", model, *extra],
                      {"ANTHROPIC_BASE_URL": server, "ANTHROPIC_API_KEY": key})
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
