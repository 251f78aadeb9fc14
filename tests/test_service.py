"""`mlxfleet service`: the launchd and systemd files it writes, checked by the tools that
read them, and the command they run, run for real. (systemd does not run as PID 1 here and
there is no launchd on Linux: loading the services is the one thing not exercised.)"""

from __future__ import annotations

import plistlib
import shlex
import shutil
import subprocess
import sys

import httpx
import pytest
from conftest import free_port
from served import manifest, wait_for

from mlxfleet import service


def test_systemd_unit_verifies_and_its_command_serves(tmp_path):
    (tmp_path / "manifests").mkdir()
    (tmp_path / "manifests" / "tiny.yaml").write_text(manifest("tiny"))
    port = free_port()
    svc = service.make(tmp_path / "manifests", port, "127.0.0.1", system=True,
                       state_dir=tmp_path / "state", platform="linux")
    assert str(svc.path) == "/etc/systemd/system/mlxfleet.service"
    text = svc.text.decode()
    assert "Restart=always" in text and "WantedBy=multi-user.target" in text
    unit = tmp_path / "mlxfleet.service"
    unit.write_bytes(svc.text)
    if shutil.which("systemd-analyze"):
        r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    user = service.make(tmp_path / "manifests", port, "127.0.0.1", system=False,
                        state_dir=tmp_path / "state", platform="linux")
    assert user.path.parts[-4:] == (".config", "systemd", "user", "mlxfleet.service")
    assert b"WantedBy=default.target" in user.text
    assert ["systemctl", "--user", "enable", "--now", "mlxfleet.service"] in user.load
    # What ExecStart runs is a working server.
    (line,) = [x for x in text.splitlines() if x.startswith("ExecStart=")]
    (tmp_path / "state" / "logs").mkdir(parents=True)
    proc = subprocess.Popen(shlex.split(line[len("ExecStart="):]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def ready():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/mlxfleet/v1/models/tiny",
                                 timeout=5).json().get("ready")
            except httpx.HTTPError:
                return False

        assert wait_for(ready, 90)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0  # SIGTERM (KillSignal) stops it cleanly


def test_launchd_plist_parses_with_keep_alive_and_logs(tmp_path):
    svc = service.make(tmp_path / "m", 8123, "127.0.0.1", system=False,
                       state_dir=tmp_path / "state", platform="darwin")
    assert svc.path.parts[-3:] == ("Library", "LaunchAgents", "dev.mlxfleet.server.plist")
    p = plistlib.loads(svc.text)
    assert p["Label"] == "dev.mlxfleet.server" and p["KeepAlive"] and p["RunAtLoad"]
    args = p["ProgramArguments"]
    assert args[0] == sys.executable and args[1:4] == ["-m", "mlxfleet", "serve"]
    assert args[args.index("--port") + 1] == "8123"
    assert p["StandardOutPath"].endswith("logs/server.log")
    daemon = service.make(tmp_path / "m", 8123, "127.0.0.1", system=True,
                          state_dir=tmp_path / "state", platform="darwin")
    assert str(daemon.path) == "/Library/LaunchDaemons/dev.mlxfleet.server.plist"
    assert daemon.load == [["launchctl", "bootstrap", "system", str(daemon.path)]]


def test_keys_never_land_in_the_service_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXFLEET_API_KEY", "secret-key")
    monkeypatch.setenv("MLXFLEET_KEEP_ALIVE", "10m")
    svc = service.make(tmp_path, 8000, "127.0.0.1", False, tmp_path, platform="linux")
    assert b"secret-key" not in svc.text and b"MLXFLEET_KEEP_ALIVE=10m" in svc.text


@pytest.mark.parametrize("action", ["install", "uninstall"])
def test_cli_dry_run_prints_what_it_would_do(tmp_path, action):
    r = subprocess.run([sys.executable, "-m", "mlxfleet", "service", action, "--dry-run",
                        "--manifests", str(tmp_path), "--port", "8124"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ("launchctl" in r.stdout) or ("systemctl" in r.stdout)
    assert not (service.make(tmp_path, 8124, "127.0.0.1", False, tmp_path).path.exists())
