"""Models on disk: pulling a source with progress, listing and removing what is stored.

One store per machine: Hugging Face checkpoints live in the Hugging Face cache
(``HF_HOME`` / ``HF_HUB_CACHE``; the same files ``mlx_lm.load`` and every other MLX tool
use), builtin and zoo models in mlxfleet's cache. A pull is ``snapshot_download`` (the
real path: resumable ``.incomplete`` files, one blob per content hash), watched from
outside for progress (the cache's blob files grow as they download), then verified:
each LFS file's SHA-256 against the hub's listing, a mismatch deleted and fetched again
once. Progress comes as Ollama's ``/api/pull`` status objects, which the CLI draws as a
bar and the gateway streams as they are.

A leaf: the CLI, the gateway and the supervisor use it; it imports nothing of theirs.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .sources import ALLOW_PATTERNS, SourceError, _check_repo_id, source_kind

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
    """A file of the checkpoint as the hub lists it."""

    name: str
    size: int
    blob: str  # the cache's blob name: the LFS SHA-256, else the git object id
    sha256: Optional[str]  # LFS files only: what the content must hash to

    @property
    def digest(self) -> str:
        return f"sha256:{self.sha256}" if self.sha256 else f"git:{self.blob}"


@dataclass(frozen=True)
class Peer:
    """Another node of the fleet that may hold a source: its URL and the headers that
    prove this node to it (the fleet key)."""

    name: str
    url: str
    headers: tuple[tuple[str, str], ...] = ()


def pull(source: str, revision: Optional[str] = None,
         on_event: Callable[[Event], None] = lambda e: None, peers: tuple[Peer, ...] = (),
         rate: int = 0) -> Path:
    """Bring ``source`` onto this machine (a no-op when it is there) and return its
    directory; progress goes to ``on_event``. ``peers``: nodes asked first (the hub only
    when none has it); ``rate``: bytes per second at most from a peer (0: no cap).
    Raises ``PullError``."""
    kind = source_kind(source)
    on_event({"status": "pulling manifest"})
    _quiet_hub()
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
    for peer in peers:
        listing = _peer_listing(peer, source, revision)
        if listing is None:
            continue
        try:
            return _from_peer(peer, source, revision, listing, on_event, rate)
        except PullError as e:  # a node that went away, or bytes that did not check out
            on_event({"status": f"from node {peer.name} failed ({e}); trying the hub"})
    commit, files = _listing(source, revision)
    blobs = _repo_dir(source) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for f in files:
        if f.sha256:  # the weights: resumable, verified before they enter the cache
            fetch_blob(hub_url(source, f.name, commit), f, blobs, on_event)
    on_event({"status": "verifying sha256 digest"})
    path = _snapshot(source, commit, files)  # the small files, and the links
    for f in files:
        if not f.sha256:
            on_event(_file_event(f, f.size))
    on_event({"status": "writing manifest"})
    _write_ref(source, revision, commit)
    on_event({"status": "success"})
    return path


def _write_ref(source: str, revision: Optional[str], commit: str) -> None:
    """The branch or tag -> this commit, as the hub library records it, so loading
    ``source`` at that revision needs no call to the hub."""
    ref = revision or "main"
    if ref != commit:
        refs = _repo_dir(source) / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        (refs / ref).write_text(commit)


def _peer_listing(peer: Peer, source: str, revision: Optional[str]
                  ) -> Optional[tuple[str, list[RemoteFile]]]:
    """What ``peer`` holds of ``source`` at ``revision``: (commit, files), or None."""
    import httpx

    try:
        r = httpx.get(f"{peer.url}{PEER_ROUTE}/listing", headers=dict(peer.headers),
                      params={"source": source, **({"revision": revision} if revision
                                                   else {})}, timeout=10)
        if r.status_code != 200:
            return None
        data = r.json()
        return data["commit"], [RemoteFile(f["name"], int(f["size"]), f["blob"],
                                           f.get("sha256")) for f in data["files"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def _from_peer(peer: Peer, source: str, revision: Optional[str],
               listing: tuple[str, list[RemoteFile]], on_event: Callable[[Event], None],
               rate: int) -> Path:
    """Every file from ``peer`` (ranged, resumable, each checked against its hash: the
    SHA-256 of weights, the git object id of the rest), then the cache's snapshot links
    and ref written as ``snapshot_download`` would have."""
    from urllib.parse import urlencode

    commit, files = listing
    on_event({"status": f"pulling from node {peer.name}"})
    repo = _repo_dir(source)
    blobs = repo / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for f in files:
        query = urlencode({"source": source, "commit": commit, "name": f.name})
        fetch_blob(f"{peer.url}{PEER_ROUTE}/file?{query}", f, blobs, on_event,
                   dict(peer.headers), rate=rate)
    snap = repo / "snapshots" / commit
    for f in files:
        link = snap / f.name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(os.path.relpath(blobs / f.blob, link.parent))
    on_event({"status": "writing manifest"})
    _write_ref(source, revision, commit)
    on_event({"status": "success"})
    return snap


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

    if source_kind(source) != "hf" or not re.fullmatch(r"[0-9a-f]{40}", commit):
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
               headers: Optional[dict] = None, attempts: int = 2, rate: int = 0) -> Path:
    """One LFS file into the cache's ``blobs/<sha256>``: ranged GETs that continue a
    ``<sha256>.incomplete`` left by an earlier pull, the whole checked against its
    SHA-256 before it is moved in; a mismatch is deleted and fetched again once.

    Hand-written on purpose: huggingface_hub 2.x downloads into a fresh temporary file
    each time (huggingface_hub#4228) and deletes it on failure, so a pull of tens of
    gigabytes killed near the end would start again from zero. The rest of the
    checkpoint still comes through ``snapshot_download``, which finds these blobs in
    place and links them into the snapshot."""

    final = blobs / f.blob
    if final.exists():
        on_event(_file_event(f, f.size))
        return final
    part = blobs / f"{f.blob}.incomplete"
    for _ in range(attempts):
        start = part.stat().st_size if part.exists() else 0
        if start > f.size:
            part.unlink()
            start = 0
        on_event(_file_event(f, start))
        if start < f.size:
            _get_range(url, part, start, f, headers, on_event, rate)
        on_event({"status": "verifying sha256 digest", "digest": f.digest})
        if _checks_out(part, f):
            os.replace(part, final)
            return final
        part.unlink()  # a flipped byte somewhere: fetched again, whole
    raise PullError(f"{f.name}: the download did not match its SHA-256 twice; removed")


def _checks_out(part: Path, f: RemoteFile) -> bool:
    """Weights against their SHA-256; other files against their git object id."""
    if f.sha256:
        return sha256_file(part) == f.sha256
    data = part.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == f.blob


def _get_range(url: str, part: Path, start: int, f: RemoteFile, headers: Optional[dict],
               on_event: Callable[[Event], None], rate: int = 0) -> None:
    import httpx
    from huggingface_hub.utils import build_hf_headers

    h = {**build_hf_headers(), **(headers or {})}
    if start:
        h["Range"] = f"bytes={start}-"
    sent = time.monotonic()
    try:
        with httpx.stream("GET", url, headers=h, follow_redirects=True,
                          timeout=httpx.Timeout(60, connect=10)) as r:
            if r.status_code == 200 and start:  # the server ignored the range: restart
                start = 0
            elif r.status_code not in (200, 206):
                raise PullError(f"{f.name}: HTTP {r.status_code} from {url}")
            done = start
            began = time.monotonic()
            with open(part, "ab" if start else "wb") as out:
                for chunk in r.iter_bytes(1 << 20):
                    out.write(chunk)
                    done += len(chunk)
                    if rate:  # a peer's bandwidth is its users' too: stay under the cap
                        ahead = (done - start) / rate - (time.monotonic() - began)
                        if ahead > 0:
                            time.sleep(ahead)
                    if time.monotonic() - sent >= PROGRESS_INTERVAL:
                        sent = time.monotonic()
                        on_event(_file_event(f, done))
            on_event(_file_event(f, done))
    except httpx.HTTPError as e:
        raise PullError(f"{f.name}: download broke off ({e or type(e).__name__}); pull again "
                        "to continue where it stopped") from None


def _snapshot(repo: str, revision: str, files: list[RemoteFile]) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, revision=revision,
                                      allow_patterns=[f.name for f in files]))
    except Exception as e:  # noqa: BLE001 - the hub's many errors: one message
        raise PullError(f"{repo}: download failed: {e}") from None


def _quiet_hub() -> None:
    """No tqdm bars from huggingface_hub on our stderr: progress is ours to report."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()


def _listing(repo: str, revision: Optional[str]) -> tuple[str, list[RemoteFile]]:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        filter_repo_objects,
    )

    api = HfApi()
    try:
        commit = api.repo_info(repo, revision=revision).sha
        tree = [f for f in api.list_repo_tree(repo, recursive=True, revision=commit)
                if isinstance(f, RepoFile)]
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError,
            EntryNotFoundError) as e:
        raise PullError(f"{repo}: not found on the hub ({type(e).__name__})", 404) from None
    except Exception as e:  # noqa: BLE001 - the hub's many network errors: one message
        raise PullError(f"{repo}: cannot reach the hub: {e}", 502) from None
    wanted = set(filter_repo_objects([f.path for f in tree], allow_patterns=ALLOW_PATTERNS))
    files = [RemoteFile(f.path, f.size, f.lfs.sha256 if f.lfs else f.blob_id,
                        f.lfs.sha256 if f.lfs else None)
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
        try:
            self.path = await asyncio.to_thread(pull, self.source, self.revision,
                                                self._from_thread, pulls.peers(), pulls.rate)
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
    """The pulls running on this machine: one per source, however many ask for it.
    ``peers``: the other nodes to ask first (a fleet's), ``rate`` their bandwidth cap."""

    def __init__(self, peers: Callable[[], tuple[Peer, ...]] = tuple, rate: int = 0) -> None:
        self.active: dict[tuple[str, Optional[str]], Pull] = {}
        self.peers, self.rate = peers, rate

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
