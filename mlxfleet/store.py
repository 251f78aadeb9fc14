"""Models on disk: pulling a source with progress, listing and removing what is stored.

One store per machine: Hugging Face checkpoints live in the Hugging Face cache
(``HF_HOME`` / ``HF_HUB_CACHE``; the same files ``mlx_lm.load`` and every other MLX tool
use), builtin and zoo models in mlxfleet's cache. A pull takes the hub's listing (the
commit, each file's size and hash), checks it (``remote_file``: plain relative names,
hex blob names, sane sizes), checks there is room on disk, then fetches each file into
the cache's ``blobs/`` (from another node of the fleet first, else the hub; resumable
``.incomplete`` files, never more bytes than listed, an idle timeout and a deadline),
checks it against the hub's hash (never a peer's word), and writes the snapshot links
and ref as ``snapshot_download`` would. Progress comes as Ollama's ``/api/pull``
status objects, which the CLI draws as a bar and the gateway streams as they are.
Pulls run on their own threads (``Pulls``), so no download ever holds up the control
plane.

A leaf: the CLI, the gateway and the supervisor use it; it imports nothing of theirs.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlencode

from .names import COMMIT, is_blob, loggable
from .sources import ALLOW_PATTERNS, SourceError, _check_repo_id, source_kind
from .units import fmt_bytes

Event = dict[str, Any]  # one of Ollama's /api/pull status objects
#: Where a node serves what it holds to the other nodes of its fleet (fleet key).
PEER_ROUTE = "/mlxfleet/v1/store"
#: How often a running download reports its bytes.
PROGRESS_INTERVAL = 0.25


class PullError(RuntimeError):
    """A pull that cannot finish; ``status`` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


@dataclass
class RemoteFile:
    """A file of the checkpoint as the hub lists it (checked: ``remote_file``)."""

    name: str
    size: int
    blob: str  # the cache's blob name: the LFS SHA-256, else the git object id
    sha256: Optional[str]  # LFS files only: what the content must hash to

    @property
    def digest(self) -> str:
        return f"sha256:{self.sha256}" if self.sha256 else f"git:{self.blob}"


#: The largest file a listing may name (a checkpoint's shards are a few GB each).
MAX_FILE_BYTES = 1 << 40


def remote_file(name: Any, size: Any, blob: Any, sha256: Any, who: str) -> RemoteFile:
    """One listed file, checked before any path is built from it: a relative name with
    no ``..`` (it becomes a link under the snapshot), a blob that is a hex digest (it
    becomes a file under ``blobs/``), a sane size. ``who`` (the hub, node X) is named in
    the error: a listing that fails this is refused whole."""
    parts = name.split("/") if isinstance(name, str) else []
    bad = (not parts or not all(parts) or any(p in (".", "..") for p in parts)
           or "\\" in name or "\0" in name or len(name) > 512)
    if bad:
        raise PullError(f"{who} listed a file name that is not a plain relative path: "
                        f"{loggable(name)}; refused")
    if not is_blob(blob) or (sha256 is not None and (not is_blob(sha256) or sha256 != blob)):
        raise PullError(f"{who} listed {loggable(name)} with a blob that is not a hex "
                        f"digest: {loggable(blob)}; refused")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
        raise PullError(f"{who} listed {loggable(name)} with an impossible size "
                        f"{loggable(size)}; refused")
    return RemoteFile(name, size, blob, sha256)


@dataclass(frozen=True)
class Peer:
    """Another node of the fleet that may hold a source: its URL, and what signs this
    node's requests to it and checks its answers (the fleet key; None: a keyless
    loopback fleet)."""

    name: str
    url: str
    me: str = ""
    key: Optional[str] = None
    tls: Any = None  # this node's FleetTLS, when the fleet has TLS between its nodes

    def client(self, timeout: Any) -> Any:
        """An ``httpx.Client`` for this peer: over TLS, the fleet CA only."""
        import httpx

        verify = self.tls.client_context() if self.tls is not None else True
        return httpx.Client(verify=verify, timeout=timeout, follow_redirects=True)

    @property
    def extensions(self) -> dict[str, str]:
        """Over TLS, the peer must show the certificate naming it (``fleet_tls``)."""
        from .fleet_tls import node_dns

        https = self.tls is not None and self.url.startswith("https:")
        return {"sni_hostname": node_dns(self.name)} if https else {}

    def headers(self, url: str) -> dict[str, str]:
        from urllib.parse import urlsplit

        from .fleet_auth import FORWARDED_HEADER, sign

        if not self.key:
            return {FORWARDED_HEADER: self.me}
        u = urlsplit(url)
        return sign(self.key, self.me, "GET", u.path + (f"?{u.query}" if u.query else ""))

    def signed(self, sent: dict[str, str], status: int, body: bytes, answer: Any) -> bool:
        from .fleet_auth import AUTH_HEADER, answer_ok

        return bool(self.key) and answer_ok(self.key, sent, status, body,
                                            answer.get(AUTH_HEADER))


@dataclass(frozen=True)
class Limits:
    """What one pull may take (the server's ``pull_*`` settings)."""

    idle_timeout: float = 60.0  # seconds without a byte
    timeout: float = 12 * 3600.0  # seconds for the whole pull
    free_margin: int = 1 << 30  # bytes of disk a pull leaves free
    peer_without_hub: bool = False  # trust a peer's signed listing when the hub is down

    @staticmethod
    def of(settings: Any) -> Limits:
        if settings is None:
            return Limits()
        return Limits(settings.pull_idle_timeout, settings.pull_timeout,
                      settings.pull_free_margin_mb << 20, settings.peer_copy_without_hub)


def pull(source: str, revision: Optional[str] = None,
         on_event: Callable[[Event], None] = lambda e: None, peers: tuple[Peer, ...] = (),
         rate: int = 0, limits: Limits = Limits()) -> Path:
    """Bring ``source`` onto this machine (a no-op when it is there) and return its
    directory; progress goes to ``on_event``. The hub's listing says which files, of
    what size and hash (a peer's bytes are checked against it, never against the
    peer's word); ``peers``: nodes asked for the bytes first (the hub when none has
    them); ``rate``: bytes per second at most from a peer (0: no cap). Raises
    ``PullError``."""
    kind = source_kind(source)
    on_event({"status": "pulling manifest"})
    if kind != "hf":
        from .sources import resolve_source

        try:
            path = resolve_source(source, revision)  # builtin: written once, here
        except SourceError as e:
            raise PullError(str(e), 404) from None
        on_event({"status": "success"})
        return path
    try:
        _check_repo_id(source)
    except SourceError as e:
        raise PullError(str(e), 400) from None
    deadline = time.monotonic() + limits.timeout
    try:
        commit, files = _listing(source, revision)
    except PullError as e:
        signed = _signed_peer_listing(peers, source, revision) \
            if e.status == 502 and limits.peer_without_hub else None
        if signed is None:
            if e.status == 502 and peers:  # say why the nodes were not asked
                raise PullError(f"{e}; nodes {', '.join(p.name for p in peers)} were not "
                                "asked: a copy from a node is checked against the hub's "
                                "listing (peer_copy_without_hub trusts a node's signed "
                                "listing instead)", 502) from None
            raise
        on_event({"status": f"the hub cannot be reached: using node {signed[0].name}'s "
                            "signed listing"})
        commit, files = signed[1]
    blobs = _repo_dir(source) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    _check_space(source, blobs, files, limits.free_margin)
    for peer in peers:
        if not _peer_holds(peer, source, commit, files):
            continue
        on_event({"status": f"pulling from node {peer.name}"})
        try:
            for f in files:
                url = f"{peer.url}{PEER_ROUTE}/file?" + urlencode(
                    {"source": source, "commit": commit, "name": f.name})
                fetch_blob(url, f, blobs, on_event, peer=peer, rate=rate, limits=limits,
                           deadline=deadline)
            break
        except PullError as e:  # a node that went away, or bytes that did not check out
            on_event({"status": f"from node {peer.name} failed ({e}); trying the hub"})
    for f in files:  # what no node gave: from the hub (files already here are skipped)
        fetch_blob(hub_url(source, f.name, commit), f, blobs, on_event, limits=limits,
                   deadline=deadline)
    on_event({"status": "verifying sha256 digest"})
    path = _link_snapshot(source, commit, files)
    on_event({"status": "writing manifest"})
    _write_ref(source, revision, commit)
    on_event({"status": "success"})
    return path


def _check_space(source: str, blobs: Path, files: list[RemoteFile], margin: int) -> None:
    """Refuse a pull that would leave less than ``margin`` bytes free, before any byte."""
    need = 0
    for f in files:
        if not (blobs / f.blob).exists():
            part = blobs / f"{f.blob}.incomplete"
            need += f.size - (part.stat().st_size if part.exists() else 0)
    free = shutil.disk_usage(blobs).free
    if need + margin > free:
        raise PullError(f"{source}: needs {fmt_bytes(need)} more on disk and "
                        f"{fmt_bytes(free)} is free (a pull leaves {fmt_bytes(margin)} free: "
                        "pull_free_margin_mb); free some space with `mlxfleet rm`", 507)


def _link_snapshot(source: str, commit: str, files: list[RemoteFile]) -> Path:
    """The cache's ``snapshots/<commit>/<name>`` links to the blobs, as
    ``snapshot_download`` writes them; every path checked to stay in the repo's folder."""
    repo = _repo_dir(source).resolve()
    snap = repo / "snapshots" / commit
    for f in files:
        link = snap / f.name
        if repo not in link.resolve().parents:  # a name remote_file let through: never
            raise PullError(f"{loggable(f.name)} would be written outside the cache")
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(repo / "blobs" / f.blob, link.parent))
    return snap


def _write_ref(source: str, revision: Optional[str], commit: str) -> None:
    """The branch or tag -> this commit, as the hub library records it, so loading
    ``source`` at that revision needs no call to the hub."""
    ref = revision or "main"
    if ref != commit:
        refs = _repo_dir(source) / "refs"
        path = (refs / ref).resolve()
        if refs.resolve() not in path.parents:
            raise PullError(f"revision {loggable(ref)} is not a branch or tag name", 400)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(commit)


def _peer_get(peer: Peer, source: str, revision: Optional[str]) -> Optional[dict]:
    """``peer``'s listing of ``source`` (a JSON object), with whether it signed it."""
    import httpx

    url = f"{peer.url}{PEER_ROUTE}/listing?" + urlencode(
        {"source": source, **({"revision": revision} if revision else {})})
    sent = peer.headers(url)
    try:
        with peer.client(10) as client:
            r = client.get(url, headers=sent, extensions=peer.extensions)
        if r.status_code != 200:
            return None
        data = r.json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    data["_signed"] = peer.signed(sent, r.status_code, r.content, r.headers)
    return data


def _peer_files(peer: Peer, data: dict) -> tuple[str, list[RemoteFile]]:
    commit = data.get("commit")
    if not isinstance(commit, str) or not COMMIT.match(commit):
        raise PullError(f"node {peer.name} listed a commit that is not a commit id")
    files = data.get("files")
    if not isinstance(files, list) or len(files) > 10_000:
        raise PullError(f"node {peer.name} sent a listing without files")
    return commit, [remote_file(f.get("name"), f.get("size"), f.get("blob"), f.get("sha256"),
                                f"node {peer.name}") for f in files if isinstance(f, dict)]


def _peer_holds(peer: Peer, source: str, commit: str, files: list[RemoteFile]) -> bool:
    """Whether ``peer`` holds every file of ``source`` at ``commit``, as the hub lists
    them (same names, same blobs)."""
    data = _peer_get(peer, source, commit)
    if data is None:
        return False
    try:
        its_commit, its_files = _peer_files(peer, data)
    except PullError:
        return False
    theirs = {(f.name, f.blob) for f in its_files}
    return its_commit == commit and all((f.name, f.blob) in theirs for f in files)


def _signed_peer_listing(peers: tuple[Peer, ...], source: str, revision: Optional[str]
                         ) -> Optional[tuple[Peer, tuple[str, list[RemoteFile]]]]:
    """With the hub down (and ``peer_copy_without_hub``): the first listing a node of
    the fleet signed with the fleet key."""
    for peer in peers:
        data = _peer_get(peer, source, revision)
        if data is None or not data.get("_signed"):
            continue
        try:
            return peer, _peer_files(peer, data)
        except PullError:
            continue
    return None


def snapshot_listing(source: str, revision: Optional[str] = None) -> Optional[dict]:
    """What this machine holds of ``source`` (for a peer): its commit and, per file, the
    size and the cache blob it is (a SHA-256 for weights, a git object id otherwise)."""
    from .sources import local_dir

    if source_kind(source) != "hf":
        return None
    d = local_dir(source, revision)
    if d is None:
        return None
    files = []
    for p in sorted(d.rglob("*")):
        if not p.is_symlink() or not p.is_file():
            continue
        blob = os.path.basename(os.readlink(p))
        files.append({"name": str(p.relative_to(d)), "size": p.stat().st_size, "blob": blob,
                      "sha256": blob if len(blob) == 64 else None})
    return {"source": source, "commit": d.name, "files": files}


def snapshot_file(source: str, commit: str, name: str) -> Optional[Path]:
    """One file of a snapshot this machine holds (for a peer), never outside it."""
    from .sources import local_dir

    if source_kind(source) != "hf" or not COMMIT.match(commit):
        return None
    d = local_dir(source, commit)
    if d is None or d.name != commit:
        return None
    p = (d / name).resolve()
    blobs = (_repo_dir(source) / "blobs").resolve()
    return p if p.is_file() and p.parent == blobs and (d / name).is_symlink() else None


def _file_event(f: RemoteFile, done: int) -> Event:
    return {"status": f"pulling {f.name}", "digest": f.digest, "total": f.size,
            "completed": min(done, f.size)}


def hub_url(repo: str, name: str, commit: str) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(repo, name, revision=commit)


def fetch_blob(url: str, f: RemoteFile, blobs: Path, on_event: Callable[[Event], None],
               peer: Optional[Peer] = None, attempts: int = 2, rate: int = 0,
               limits: Limits = Limits(), deadline: Optional[float] = None) -> Path:
    """One file into the cache's ``blobs/<digest>``: ranged GETs that continue a
    ``<digest>.incomplete`` left by an earlier pull, the whole checked against its hash
    (SHA-256, or the git object id of a small file) before it is moved in; a mismatch
    is deleted and fetched again once. ``peer``: the node asked (its requests signed),
    else the hub.

    Hand-written on purpose: huggingface_hub 2.x downloads into a fresh temporary file
    each time (huggingface_hub#4228) and deletes it on failure, so a pull of tens of
    gigabytes killed near the end would start again from zero; and every byte it writes
    is bounded here by the size the hub listed, under the cache's folder."""
    if not is_blob(f.blob):  # remote_file checked it: never a path
        raise PullError(f"{loggable(f.blob)} is not a blob name")
    final = blobs / f.blob
    if final.exists():
        on_event(_file_event(f, f.size))
        return final
    part = blobs / f"{f.blob}.incomplete"
    deadline = deadline or time.monotonic() + limits.timeout
    for _ in range(attempts):
        start = part.stat().st_size if part.exists() else 0
        if start > f.size:
            part.unlink()
            start = 0
        on_event(_file_event(f, start))
        if start < f.size:
            _get_range(url, part, start, f, peer, on_event, rate, limits, deadline)
        on_event({"status": "verifying sha256 digest", "digest": f.digest})
        if _checks_out(part, f):
            os.replace(part, final)
            return final
        part.unlink()  # a flipped byte somewhere: fetched again, whole
    raise PullError(f"{f.name}: the download did not match its SHA-256 twice; removed")


def _checks_out(part: Path, f: RemoteFile) -> bool:
    """Weights against their SHA-256; other files against their git object id."""
    if not part.exists() or part.stat().st_size != f.size:
        return False
    if f.sha256:
        return sha256_file(part) == f.sha256
    data = part.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == f.blob


#: Bytes written per read: a pull stopped midway keeps all but the last of them.
_CHUNK = 64 << 10


def _get_range(url: str, part: Path, start: int, f: RemoteFile, peer: Optional[Peer],
               on_event: Callable[[Event], None], rate: int, limits: Limits,
               deadline: float) -> None:
    """Append bytes ``start..f.size`` of ``url`` to ``part``: never more than listed, no
    longer than ``limits.idle_timeout`` without a byte or past ``deadline``."""
    import httpx

    if peer is not None:
        h = peer.headers(url)  # never the hub's token: a peer is not the hub
    else:
        from huggingface_hub.utils import build_hf_headers

        h = build_hf_headers()
    if start:
        h["Range"] = f"bytes={start}-"
    who = f"node {peer.name}" if peer is not None else "the hub"
    sent = time.monotonic()
    try:
        timeout = httpx.Timeout(limits.idle_timeout, connect=10)
        client = peer.client(timeout) if peer is not None else \
            httpx.Client(timeout=timeout, follow_redirects=True)
        with client, client.stream("GET", url, headers=h, extensions=peer.extensions
                                   if peer is not None else {}) as r:
            if r.status_code == 200 and start:  # the server ignored the range: restart
                start = 0
            elif r.status_code not in (200, 206):
                raise PullError(f"{f.name}: HTTP {r.status_code} from {who}")
            length = r.headers.get("content-length", "")
            if length.isdigit() and start + int(length) > f.size:
                raise PullError(f"{f.name}: {who} would send {start + int(length)} bytes; "
                                f"it is listed at {f.size}; refused")
            done = start
            began = time.monotonic()
            with open(part, "ab" if start else "wb") as out:
                for chunk in r.iter_bytes(_CHUNK):
                    if done + len(chunk) > f.size:
                        out.truncate(start)
                        raise PullError(f"{f.name}: {who} sent more than the {f.size} "
                                        "bytes it is listed at; stopped")
                    out.write(chunk)
                    done += len(chunk)
                    now = time.monotonic()
                    if now > deadline:
                        raise PullError(f"{f.name}: the pull took longer than "
                                        f"{limits.timeout:g}s (pull_timeout); pull again "
                                        "to continue where it stopped", 504)
                    if rate:  # a peer's bandwidth is its users' too: stay under the cap
                        ahead = (done - start) / rate - (now - began)
                        if ahead > 0:
                            time.sleep(ahead)
                    if now - sent >= PROGRESS_INTERVAL:
                        sent = now
                        on_event(_file_event(f, done))
            on_event(_file_event(f, done))
    except httpx.TimeoutException:
        raise PullError(f"{f.name}: {who} sent nothing for {limits.idle_timeout:g}s "
                        "(pull_idle_timeout); pull again to continue where it stopped",
                        504) from None
    except httpx.HTTPError as e:
        raise PullError(f"{f.name}: download from {who} broke off ({e or type(e).__name__});"
                        " pull again to continue where it stopped") from None


def _listing(repo: str, revision: Optional[str]) -> tuple[str, list[RemoteFile]]:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        disable_progress_bars,
        filter_repo_objects,
    )

    disable_progress_bars()  # progress is ours to report
    api = HfApi()
    try:
        commit = api.repo_info(repo, revision=revision).sha
        if not isinstance(commit, str) or not COMMIT.match(commit):
            raise PullError(f"{repo}: the hub answered with a commit that is not a commit "
                            f"id: {loggable(commit)}")
        tree = [f for f in api.list_repo_tree(repo, recursive=True, revision=commit)
                if isinstance(f, RepoFile)]
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError,
            EntryNotFoundError) as e:
        raise PullError(f"{repo}: not found on the hub ({type(e).__name__})", 404) from None
    except PullError:
        raise
    except Exception as e:  # noqa: BLE001 - the hub's many network errors: one message
        raise PullError(f"{repo}: cannot reach the hub: {e}", 502) from None
    wanted = set(filter_repo_objects([f.path for f in tree], allow_patterns=ALLOW_PATTERNS))
    files = [remote_file(f.path, f.size, f.lfs.sha256 if f.lfs else f.blob_id,
                         f.lfs.sha256 if f.lfs else None, "the hub")
             for f in tree if f.path in wanted]
    if not any(f.name.endswith(".safetensors") for f in files):
        raise PullError(f"{repo}: no safetensors weights in this repository (MLX loads "
                        "safetensors)", 404)
    return commit, files


def _repo_dir(repo: str) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- what is stored ------------------------------------------------------------------

@dataclass
class Stored:
    """One source on this machine's disk."""

    source: str
    path: str
    size: int  # bytes on disk
    revisions: list[str] = field(default_factory=list)
    modified: float = 0.0  # last write, epoch seconds

    def as_dict(self, used_by: list[str]) -> dict[str, Any]:
        return {"source": self.source, "path": self.path, "sizeBytes": self.size,
                "revisions": self.revisions, "modifiedAt": self.modified, "usedBy": used_by}


def stored(created: Optional[Path] = None) -> list[Stored]:
    """Every source on disk: Hugging Face checkpoints, builtin models, and the
    checkpoints ``/api/create`` wrote under ``created`` (their source is their path)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    out: list[Stored] = []
    try:
        for repo in scan_cache_dir().repos:
            if repo.repo_type == "model":
                out.append(Stored(repo.repo_id, str(repo.repo_path), repo.size_on_disk,
                                  sorted(r.commit_hash[:12] for r in repo.revisions),
                                  repo.last_modified))
    except CacheNotFound:
        pass
    out.extend(_builtins())
    for d in sorted(created.iterdir()) if created is not None and created.is_dir() else []:
        if (d / "config.json").is_file():
            out.append(Stored(str(d), str(d), _du(d), [], d.stat().st_mtime))
    return sorted(out, key=lambda s: s.source)


def _builtins() -> list[Stored]:
    from .builtin import BUILTIN_PREFIX, builtin_cache_dir

    out = []
    root = builtin_cache_dir()
    for d in sorted(root.glob("*-v*")) if root.is_dir() else []:
        name = d.name.rsplit("-v", 1)[0]
        out.append(Stored(BUILTIN_PREFIX + name, str(d), _du(d), [], d.stat().st_mtime))
    return out


def _du(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and not p.is_symlink())


def remove(source: str, created: Optional[Path] = None) -> Optional[int]:
    """Delete a stored source; the bytes freed, or None when it is not stored."""
    for s in stored(created):
        if s.source == source:
            shutil.rmtree(s.path, ignore_errors=True)
            return s.size
    return None


def needs_pull(source: str, revision: Optional[str] = None) -> bool:
    """Whether loading ``source`` needs a download first: a Hugging Face repo id whose
    files are not on disk (builtin models are written, directories read, in place)."""
    from .sources import local_dir

    return source_kind(source) == "hf" and local_dir(source, revision) is None


# ---- pulls in progress ------------------------------------------------------------------

class Pull:
    """One pull running on a thread, watched by any number of clients (``events``), the
    dashboard and ``describe`` (``progress``). Started through ``Pulls``."""

    def __init__(self, source: str, revision: Optional[str], pulls: Pulls):
        self.source, self.revision = source, revision
        self.started = time.time()
        self.latest: dict[str, Event] = {}  # by status: what a late watcher replays
        self.status = "starting"
        self.path: Optional[Path] = None
        self.error: Optional[PullError] = None
        self._loop = asyncio.get_running_loop()
        self._watchers: list[asyncio.Queue] = []
        self._done = asyncio.Event()
        self.listed = asyncio.Event()  # the hub answered with the files (or it failed)
        self.task = asyncio.create_task(self._run(pulls), name=f"pull:{source}")

    async def _run(self, pulls: Pulls) -> None:
        self.status = "queued"  # (the dashboard shows it; no event: clients see the pull)
        try:
            self.path = await self._loop.run_in_executor(pulls.pool, self._pull, pulls)
        except PullError as e:
            self.error = e
        except Exception as e:  # noqa: BLE001 - any failure is this pull's, reported
            self.error = PullError(f"{self.source}: {e}")
        finally:
            pulls.finished(self)
            self.listed.set()
            self._done.set()
            for q in self._watchers:
                q.put_nowait(None)

    def _pull(self, pulls: Pulls) -> Path:
        return pull(self.source, self.revision, self._from_thread, pulls.peers(), pulls.rate,
                    pulls.limits)

    def _from_thread(self, event: Event) -> None:
        self._loop.call_soon_threadsafe(self._publish, event)

    def _publish(self, event: Event) -> None:
        self.latest[event["status"]] = event
        self.status = event["status"]
        if "total" in event:
            self.listed.set()
        for q in self._watchers:
            q.put_nowait(event)

    async def events(self) -> Any:
        """Every event from now (after the latest of each kind so far), then the end."""
        q: asyncio.Queue = asyncio.Queue()
        for e in list(self.latest.values()):
            q.put_nowait(e)
        if self._done.is_set():
            q.put_nowait(None)
        else:
            self._watchers.append(q)
        try:
            while (e := await q.get()) is not None:
                yield e
        finally:
            if q in self._watchers:
                self._watchers.remove(q)

    async def wait(self) -> Path:
        """The checkpoint's directory once pulled; raises its ``PullError``."""
        await self._done.wait()
        if self.error is not None:
            raise self.error
        return self.path

    def progress(self) -> dict[str, Any]:
        files = [e for e in self.latest.values() if "total" in e]
        total = sum(e["total"] for e in files)
        done = sum(e["completed"] for e in files)
        elapsed = max(time.time() - self.started, 1e-6)
        return {"source": self.source, "revision": self.revision,
                "completedBytes": done, "totalBytes": total or None,
                "bytesPerSecond": round(done / elapsed),
                "status": self.status,
                "startedAt": self.started}


class Pulls:
    """The pulls running on this machine: one per source, however many ask for it, at
    most ``concurrency`` at once on threads of their own (the default pool also runs
    apply, delete and the store's listings: six slow pulls there froze them for
    minutes). ``peers``: the other nodes to ask first (a fleet's), ``rate`` their
    bandwidth cap, ``limits`` each pull's timeouts and disk margin."""

    def __init__(self, peers: Callable[[], tuple[Peer, ...]] = tuple, rate: int = 0,
                 limits: Limits = Limits(), concurrency: int = 2) -> None:
        self.active: dict[tuple[str, Optional[str]], Pull] = {}
        self.peers, self.rate, self.limits = peers, rate, limits
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="pull")

    def start(self, source: str, revision: Optional[str] = None) -> Pull:
        key = (source, revision)
        if key not in self.active:
            self.active[key] = Pull(source, revision, self)
        return self.active[key]

    def finished(self, p: Pull) -> None:
        if self.active.get((p.source, p.revision)) is p:
            del self.active[(p.source, p.revision)]

    def status(self) -> list[dict[str, Any]]:
        return [p.progress() for p in self.active.values()]
