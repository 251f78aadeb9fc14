"""A local stand-in for the Hugging Face Hub, for pull tests.

The hub cannot be reached from here, so this answers the routes ``huggingface_hub``
calls, pointed at it through ``HF_ENDPOINT``: repo info, the file tree (with LFS
hashes), and ``/resolve`` with HEAD and ranged GETs. Production keeps the real path
(``snapshot_download`` against huggingface.co); only the server is a stand-in.

Knobs for the tests: ``throttle`` (seconds per 64 KiB chunk, so a pull can be caught
midway), ``corrupt`` (file names whose next GET has its first byte flipped), and
``log`` (every request: method, path, Range header).

And a hostile hub's, for the trust-boundary tests: ``lie`` (file name -> fields of its
listing entry to replace: a ``path`` or LFS ``oid`` that climbs out of the cache, a
``size``), ``overflow`` (file name -> bytes sent past the file, with no
Content-Length), ``stall`` (seconds of silence after the headers of a file's GET).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

CHUNK = 64 << 10


class Repo:
    def __init__(self, files: dict[str, bytes], commit: str = "c0ffee" * 6 + "abcd"):
        self.files, self.commit = files, commit

    @staticmethod
    def from_dir(d: Path, **kw) -> Repo:
        return Repo({p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}, **kw)

    def entry(self, name: str) -> dict:
        data = self.files[name]
        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        e = {"type": "file", "oid": oid, "size": len(data), "path": name}
        if is_lfs(name):
            e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                        "pointerSize": 134}
        return e


def _lied(entry: dict, lie: dict) -> dict:
    entry = {**entry, **{k: v for k, v in lie.items() if k != "oid"}}
    if "oid" in lie and "lfs" in entry:
        entry["lfs"] = {**entry["lfs"], "oid": lie["oid"]}
    return entry


def is_lfs(name: str) -> bool:
    return name.endswith(".safetensors")


class Hub:
    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.throttle = 0.0
        self.corrupt: set[str] = set()
        self.lie: dict[str, dict] = {}
        self.overflow: dict[str, int] = {}
        self.stall = 0.0
        self.log: list[tuple[str, str, Optional[str]]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._serve(self, head=True)

            def do_GET(self):
                hub._serve(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def env(self, cache: Path) -> dict[str, str]:
        """What a server needs to pull from this hub into ``cache`` (its own HF cache)."""
        return {"HF_ENDPOINT": self.url, "HF_HUB_CACHE": str(cache),
                "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _entry(self, repo: Repo, name: str) -> dict:
        return _lied(repo.entry(name), self.lie.get(name, {}))

    # ---- routes -----------------------------------------------------------------------

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = h.path.split("?", 1)[0]
        self.log.append((h.command, path, h.headers.get("Range")))
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", path)
        if info or tree:
            name = (info or tree).group(1)
            repo = self.repos.get(name)
            if repo is None:
                return _json(h, 404, {"error": "Repository not found"},
                             {"X-Error-Code": "RepoNotFound"})
            if tree:
                return _json(h, 200, [self._entry(repo, n) for n in repo.files])
            return _json(h, 200, {"id": name, "modelId": name, "sha": repo.commit,
                                  "private": False, "siblings": [
                                      {"rfilename": n} for n in repo.files]})
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo = self.repos.get(m.group(1)) if m else None
        if repo is None or m.group(3) not in repo.files:
            return _json(h, 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
        name = m.group(3)
        data = repo.files[name]
        entry = repo.entry(name)
        etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
        start = 0
        rng = h.headers.get("Range")
        if rng and (r := re.fullmatch(r"bytes=(\d+)-(\d*)", rng)):
            start = int(r.group(1))
        body = data[start:]
        if not head and name in self.corrupt:  # the next GET, whole or resumed
            self.corrupt.discard(name)
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        extra = self.overflow.get(name, 0)
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", repo.commit)
        h.send_header("ETag", f'"{etag}"')
        if extra and not head:  # more than listed, with no length to give it away
            body += b"\0" * extra
            h.send_header("Connection", "close")
        else:
            h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        if self.stall:
            h.wfile.flush()
            time.sleep(self.stall)
        try:
            for i in range(0, len(body), CHUNK):
                h.wfile.write(body[i:i + CHUNK])
                h.wfile.flush()
                if self.throttle:
                    time.sleep(self.throttle)
        except (BrokenPipeError, ConnectionResetError):
            pass


def _json(h: BaseHTTPRequestHandler, status: int, obj, headers: Optional[dict] = None) -> None:
    data = json.dumps(obj).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(data)
