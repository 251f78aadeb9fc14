"""`mlxfleet pull`, `mlxfleet get sources` and `mlxfleet rm`: the store from the CLI.

``pull`` asks the running server (``/api/pull``: the dashboard shows it, one download
however many ask) and draws its progress; with no server it pulls in this process,
the same code. ``get sources`` and ``rm`` go through the control API, which knows
which models use each source.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional

from .units import fmt_age, fmt_bytes


def add_store_commands(sub: Any) -> None:
    p = sub.add_parser("pull", help="download a model's weights onto this machine",
                       description="Pull a Hugging Face repo id (or the source of a model "
                       "of the server) into the local store, with progress; resumable and "
                       "checked against the hub's SHA-256.")
    p.add_argument("source", help="owner/name, or a model name of the server")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    r = sub.add_parser("rm", help="delete a source from the local store")
    r.add_argument("source")
    for q in (p, r):
        q.add_argument("--server", default=None, help="gateway URL")


class Progress:
    """One line of progress: bytes, rate and time left, redrawn in place on a terminal;
    on anything else a line per step and per finished file."""

    def __init__(self, out: Any = sys.stdout):
        self.out, self.tty = out, out.isatty()
        self.files: dict[str, tuple[int, int]] = {}
        self.started = time.monotonic()
        self._bar = False  # a bar is drawn on the current line

    def __call__(self, e: dict) -> None:
        if "error" in e:
            raise SystemExit(f"error: {e['error']}")
        if "total" in e:
            done_before = self.files.get(e["status"], (0, -1))
            self.files[e["status"]] = (e["completed"], e["total"])
            if self.tty:
                self._draw()
                self._bar = True
            elif e["completed"] == e["total"] != done_before[0]:
                self._line(f"{e['status']}: {fmt_bytes(e['total'])}")
            return
        if self._bar:
            self.out.write("\n")
            self._bar = False
        self._line(e["status"])

    def _draw(self) -> None:
        done = sum(c for c, _ in self.files.values())
        total = sum(t for _, t in self.files.values()) or 1
        rate = done / max(time.monotonic() - self.started, 1e-3)
        left = (total - done) / rate if rate > 0 else None
        self.out.write(f"\rpulling {done * 100 // total:3d}% {fmt_bytes(done)} / "
                       f"{fmt_bytes(total)}  {fmt_bytes(int(rate))}/s  "
                       f"{fmt_age(left) if left is not None else '?'} left   ")
        self.out.flush()

    def _line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def run_pull(args: Any, server_url: str, headers: dict) -> int:
    import httpx

    draw = Progress()
    body = {"model": args.source, **({"revision": args.revision} if args.revision else {})}
    try:
        with httpx.stream("POST", server_url + "/api/pull", json=body, headers=headers,
                          timeout=httpx.Timeout(None, connect=5)) as r:
            if r.status_code >= 400:
                r.read()
                raise SystemExit(f"error: {_message(r)}")
            for line in r.iter_lines():
                if line.strip():
                    draw(json.loads(line))
        return 0
    except httpx.ConnectError:
        pass  # no server: pull here
    from .settings import ServerSettings
    from .store import Limits, PullError, pull

    try:  # the same limits as a server's pull (MLXFLEET_PULL_* settings)
        pull(args.source, args.revision, draw, limits=Limits.of(ServerSettings()))
    except PullError as e:
        raise SystemExit(f"error: {e}") from None
    return 0


def print_sources(data: dict, output: str) -> None:
    if output == "json":
        print(json.dumps(data, indent=2))
        return
    rows = [["SOURCE", "SIZE", "USED BY", "REVISIONS"]]
    for s in data["items"]:
        rows.append([s["source"], fmt_bytes(s["sizeBytes"]), ",".join(s["usedBy"]) or "-",
                     ",".join(s["revisions"]) or "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                    for r in rows) if len(rows) > 1 else "No sources on disk.")
    for p in data.get("pulls", []):
        total = p["totalBytes"]
        print(f"pulling {p['source']}: {fmt_bytes(p['completedBytes'])}"
              + (f" / {fmt_bytes(total)}" if total else "") + f" ({p['status']})")


def _message(r: Any) -> Optional[str]:
    try:
        err = r.json()["error"]
        return err["message"] if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return r.text
