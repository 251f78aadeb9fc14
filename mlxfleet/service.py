"""``mlxfleet service install|uninstall|status``: run the server at login or boot.

macOS gets a launchd agent (``~/Library/LaunchAgents``) or, with ``--system``, a
LaunchDaemon (``/Library/LaunchDaemons``, runs before anyone logs in); Linux gets a
systemd user unit or, with ``--system``, a system unit. Both restart the server if it
exits and write its output to files in the state directory.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

LABEL = "dev.mlxfleet.server"
UNIT = "mlxfleet.service"


@dataclass
class Service:
    """Where the service file goes and what it contains."""

    path: Path
    text: bytes
    load: list[list[str]]  # commands that install and start it
    unload: list[list[str]]  # commands that stop it
    status: list[str]


def server_command(manifests: Path, port: int, host: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "mlxfleet", "serve", "--manifests", str(manifests),
            "--host", host, "--port", str(port), *extra]


def launchd(cmd: list[str], logs: Path, system: bool, env: dict[str, str]) -> Service:
    home = Path("/Library/LaunchDaemons") if system else \
        Path.home() / "Library" / "LaunchAgents"
    plist = {"Label": LABEL, "ProgramArguments": cmd, "RunAtLoad": True, "KeepAlive": True,
             "ProcessType": "Interactive",  # inference wants the performance cores
             "StandardOutPath": str(logs / "server.log"),
             "StandardErrorPath": str(logs / "server.log"),
             "EnvironmentVariables": {"PYTHONUNBUFFERED": "1", **env}}
    path = home / f"{LABEL}.plist"
    domain = "system" if system else f"gui/{os.getuid()}"
    return Service(path, plistlib.dumps(plist),
                   load=[["launchctl", "bootstrap", domain, str(path)]],
                   unload=[["launchctl", "bootout", f"{domain}/{LABEL}"]],
                   status=["launchctl", "print", f"{domain}/{LABEL}"])


def systemd(cmd: list[str], logs: Path, system: bool, env: dict[str, str]) -> Service:
    lines = ["[Unit]", "Description=mlxfleet: local LLMs from manifests",
             "After=network.target", "", "[Service]", "Type=simple",
             f"ExecStart={shlex.join(cmd)}", "Restart=always", "RestartSec=2",
             "KillSignal=SIGTERM", "TimeoutStopSec=60",
             f"StandardOutput=append:{logs / 'server.log'}",
             f"StandardError=append:{logs / 'server.log'}",
             "Environment=PYTHONUNBUFFERED=1",
             *(f"Environment={shlex.quote(f'{k}={v}')}" for k, v in sorted(env.items())),
             "", "[Install]", f"WantedBy={'multi-user.target' if system else 'default.target'}",
             ""]
    path = Path("/etc/systemd/system") / UNIT if system else \
        Path.home() / ".config" / "systemd" / "user" / UNIT
    ctl = ["systemctl"] if system else ["systemctl", "--user"]
    return Service(path, "\n".join(lines).encode(),
                   load=[[*ctl, "daemon-reload"], [*ctl, "enable", "--now", UNIT]],
                   unload=[[*ctl, "disable", "--now", UNIT]],
                   status=[*ctl, "status", "--no-pager", UNIT])


def make(manifests: Path, port: int, host: str, system: bool, state_dir: Path,
         extra: Optional[list[str]] = None, platform: str = sys.platform) -> Service:
    """The service for this machine (``platform`` decides launchd or systemd)."""
    cmd = server_command(manifests.resolve(), port, host,
                         ["--state-dir", str(state_dir), *(extra or [])])
    logs = state_dir / "logs"
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("MLXFLEET_", "HF_")) and k not in ("MLXFLEET_API_KEY",
                                                              "MLXFLEET_ADMIN_KEY")}
    build = launchd if platform == "darwin" else systemd
    return build(cmd, logs, system, env)


def run(commands: list[list[str]], dry: bool) -> int:
    for c in commands:
        print("+", shlex.join(c))
        if dry:
            continue
        if shutil.which(c[0]) is None:
            print(f"error: {c[0]} is not available on this machine", file=sys.stderr)
            return 1
        r = subprocess.run(c)
        if r.returncode != 0:
            return r.returncode
    return 0


def install(svc: Service, state_dir: Path, dry: bool = False) -> int:
    print(f"writing {svc.path}")
    if not dry:
        svc.path.parent.mkdir(parents=True, exist_ok=True)
        (state_dir / "logs").mkdir(parents=True, exist_ok=True, mode=0o700)
        svc.path.write_bytes(svc.text)
    return run(svc.load, dry)


def uninstall(svc: Service, dry: bool = False) -> int:
    code = run(svc.unload, dry)
    if not dry and svc.path.exists():
        svc.path.unlink()
        print(f"removed {svc.path}")
    return code
