"""A lying fleet peer, for the trust-boundary tests of peer copy.

It answers the two routes a node asks another when it copies weights
(``/mlxfleet/v1/store/listing`` and ``/file``), signs its answers with the fleet key
as a real node does (it holds the key: a compromised member, or a process that stole
it), and lies as ``mode`` says:

- ``traversal``: lists a file whose name and blob climb out of the cache
  (``../../..``), pointing at ``target``;
- ``substitute``: lists exactly what the hub lists (names, blobs, sizes) but serves
  other bytes (weights of its own);
- ``honest``: serves the real files (a control).

``run_pull`` runs ``mlxfleet.store.pull`` in a fresh process pointed at a hub (through
``Hub.env``) with this peer as the fleet's only other node: the code a node runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from hub import Repo

from mlxfleet.fleet_auth import AUTH_HEADER, Verifier, sign_answer


class LyingPeer:
    def __init__(self, repo: Repo, key: str, mode: str = "honest", target: str = "/tmp/x"):
        self.repo, self.key, self.mode, self.target = repo, key, mode, target
        self.verifier = Verifier(key)
        self.log: list[str] = []
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                peer._serve(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _listing(self, source: str) -> dict:
        files = []
        for name in self.repo.files:
            e = self.repo.entry(name)
            blob = e["lfs"]["oid"] if "lfs" in e else e["oid"]
            files.append({"name": name, "size": e["size"], "blob": blob,
                          "sha256": blob if "lfs" in e else None})
        if self.mode == "traversal":
            files.append({"name": f"../../../../../../..{self.target}/link", "size": 5,
                          "blob": f"../../../../../../..{self.target}/owned", "sha256": None})
        return {"source": source, "commit": self.repo.commit, "files": files}

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        u = urlsplit(h.path)
        q = {k: v[0] for k, v in parse_qs(u.query).items()}
        self.log.append(u.path)
        signed = self.verifier.check(h.headers, "GET", h.path)  # a real node's request
        if u.path.endswith("/store/listing"):
            body, ctype = json.dumps(self._listing(q.get("source", ""))).encode(), \
                "application/json"
        elif u.path.endswith("/store/file"):
            data = self.repo.files.get(q.get("name", ""), b"owned")
            body = data if self.mode == "honest" else bytes(len(data))  # zeros: not its hash
            ctype = "application/octet-stream"
        else:
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        h.send_response(200)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.send_header(AUTH_HEADER, sign_answer(self.key, signed.nonce, 200, body))
        h.end_headers()
        h.wfile.write(body)


_PULL = """
import json, sys
from mlxfleet.store import Limits, Peer, PullError, pull
a = json.loads(sys.argv[1])
peers = tuple(Peer(p["name"], p["url"], "a", p["key"]) for p in a["peers"])
try:
    path = pull(a["source"], None, lambda e: print(json.dumps(e), flush=True), peers,
                limits=Limits(**a["limits"]))
    print("OK", path)
except PullError as e:
    print("ERR", e.status, e)
"""


def run_pull(env: dict, source: str, peers: list[dict] = (), limits: dict | None = None,
             timeout: float = 120) -> tuple[bool, str]:
    """Pull ``source`` in a new process (``env``: ``Hub.env``'s); (succeeded, output)."""
    import os

    args = json.dumps({"source": source, "peers": list(peers), "limits": limits or {}})
    r = subprocess.run([sys.executable, "-c", _PULL, args], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=timeout)
    out = r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    return last.startswith("OK"), out


def written_under(root: Path) -> list[str]:
    """Every file and link under ``root`` (what a hostile answer may have planted)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() or p.is_symlink())
