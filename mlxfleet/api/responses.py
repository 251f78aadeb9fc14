"""The Responses API's state, kept by the gateway: stored responses and
``previous_response_id``.

Workers are stateless formatters (``worker/responses.py``); this module keeps
finished responses in SQLite under the state directory (WAL; one thread does every
database call, so the event loop never waits on the disk), bounded by count, bytes
and age, answers ``GET`` and ``DELETE /v1/responses/{id}`` and ``GET .../input_items``,
and turns ``previous_response_id`` into the whole conversation sent as ``input`` (the
worker's prompt cache makes that resend cheap). Responses created with ``store: false``
are not kept.

A response belongs to the API key that created it (stored as a hash): another key
gets a 404 and can neither read, continue nor delete it. A response is stored before
its last byte reaches the client, so an acknowledged response survives a crash; a
write the database refuses (another process holds a lock) never costs the client its
answer: the response is kept in memory and written again in the background. A
database that does not open (a corrupt file) is moved aside with a warning and a new
one made; the file is the user's alone (0600). In a
fleet the gateway names the response's id after its node (``resp_<hex>_<node>``), and
any node answers for it by asking that node.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from quart import Quart, g, request

from ..files import private_dir, private_file
from ..wire import HISTORY_FIELD, RESPONSE_ID_FIELD, APIError
from .guard import presented_key

log = logging.getLogger("mlxfleet.gateway")
#: Seconds a write waits for another process's lock before it is queued for later.
_BUSY_TIMEOUT = 1.0
#: Background tries of a write the database refused, a second apart.
_RETRIES = 600

#: The header a node sends with a request for a stored response on behalf of a client
#: (trusted only with the fleet key): whose responses it may see.
OWNER_HEADER = "X-Mlxfleet-Owner"


@dataclass
class Stored:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]  # this request's own input (for input_items)
    conversation: list[dict[str, Any]]  # everything the model saw as input


@dataclass
class Pending:
    """A request on its way to a worker: what to store once its response is known."""

    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]
    owner: str


def _items(inp: Any) -> list[dict[str, Any]]:
    """``input`` as a list of items, each with an id (as OpenAI lists them)."""
    items = [{"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": inp}]}] if isinstance(inp, str) \
        else [dict(i) for i in inp if isinstance(i, dict)] if isinstance(inp, list) else []
    for it in items:
        it.setdefault("id", f"msg_{uuid.uuid4().hex[:24]}")
    return items


def owner_of(headers: Any, has_keys: bool, forwarded: bool) -> str:
    """Who a stored response belongs to: a hash of the client's API key ("" without
    keys: one owner, the machine's user). A node asking for a response on a client's
    behalf (``forwarded``: the guard checked it) says whose it is."""
    if forwarded and headers.get(OWNER_HEADER.lower()) is not None:
        return headers.get(OWNER_HEADER.lower())
    key = presented_key(headers) if has_keys else None
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


def node_of(rid: str) -> Optional[str]:
    """The node named in a fleet response id (``resp_<hex>_<node>``)."""
    parts = rid.split("_")
    return parts[2] if len(parts) == 3 and parts[0] == "resp" and parts[2] else None


_SCHEMA = """
create table if not exists responses (
  id text primary key,
  owner text not null,
  created real not null,
  size integer not null,
  response text not null,
  input_items text not null,
  conversation text not null
);
create index if not exists responses_created on responses(created);
"""


class ResponseStore:
    """Stored responses in SQLite at ``path``. Every method that touches the database is
    a coroutine that runs on the store's one thread."""

    def __init__(self, path: Path, max_count: int, max_bytes: int, ttl: float,
                 node: Optional[str] = None):
        self.max_count, self.max_bytes, self.ttl, self.node = max_count, max_bytes, ttl, node
        self.path = path
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="responses-db")
        self._db: Optional[sqlite3.Connection] = None
        #: responses whose write the database refused, by id: (owner, stored), kept
        #: (and answered from) until a background retry writes them
        self._unwritten: dict[str, tuple[str, Stored]] = {}
        self._retries: set[asyncio.Task] = set()
        #: set by the gateway in a fleet: ask another node for one of its responses
        self.remote: Optional[Callable[[str, str, str, str], Awaitable[Optional[dict]]]] = None
        self._pool.submit(self._opened)  # at start: a corrupt file is dealt with now

    # ---- the database thread ---------------------------------------------

    def _opened(self) -> Optional[sqlite3.Connection]:
        try:
            return self._conn()
        except (sqlite3.Error, OSError) as e:
            log.error("responses database %s cannot be opened: %s", self.path, e)
            return None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            private_dir(self.path.parent)
            try:
                self._db = self._connect()
            except sqlite3.DatabaseError as e:
                if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                    raise
                aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
                log.warning("responses database %s does not open (%s): moved aside to %s; "
                            "starting a new one", self.path, e, aside.name)
                os.replace(self.path, aside)
                for extra in ("-wal", "-shm"):
                    Path(f"{self.path}{extra}").unlink(missing_ok=True)
                self._db = self._connect()
        return self._db

    def _connect(self) -> sqlite3.Connection:
        private_file(self.path)  # SQLite gives its -wal and -shm files the same mode
        db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None,
                             timeout=_BUSY_TIMEOUT)
        try:
            db.execute("pragma journal_mode=wal")
            db.execute("pragma synchronous=normal")  # a process crash loses nothing
            db.executescript(_SCHEMA)
            ok = db.execute("pragma quick_check").fetchone()[0]
            if ok != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {ok}")
        except BaseException:
            db.close()
            raise
        return db

    async def _run(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(self._conn()))

    # ---- reads and writes --------------------------------------------------

    async def get(self, rid: str, owner: str) -> Optional[Stored]:
        held = self._unwritten.get(rid)
        if held is not None:
            return held[1] if held[0] == owner else None
        cutoff = time.time() - self.ttl
        row = await self._run(lambda db: db.execute(
            "select response, input_items, conversation from responses where id = ? and "
            "owner = ? and created >= ?", (rid, owner, cutoff)).fetchone())
        if row is None:
            return None
        return Stored(*(json.loads(x) for x in row))

    async def delete(self, rid: str, owner: str) -> bool:
        held = self._unwritten.get(rid)
        if held is not None and held[0] == owner:
            del self._unwritten[rid]
            return True
        n = await self._run(lambda db: db.execute(
            "delete from responses where id = ? and owner = ?", (rid, owner)).rowcount)
        return n > 0

    async def put(self, response: dict[str, Any], pending: Pending) -> None:
        rid = response.get("id")
        if not isinstance(rid, str) or response.get("store") is False:
            return
        row = (json.dumps(response), json.dumps(pending.input_items),
               json.dumps(pending.conversation))
        size = sum(map(len, row))
        if size > self.max_bytes:
            return
        now = time.time()

        def write(db: sqlite3.Connection) -> None:
            with db:  # one transaction: the row and the bounds it enforces
                db.execute("insert or replace into responses values (?, ?, ?, ?, ?, ?, ?)",
                           (rid, pending.owner, now, size, *row))
                db.execute("delete from responses where created < ?", (now - self.ttl,))
                db.execute("delete from responses where id in (select id from responses "
                           "order by created desc limit -1 offset ?)", (self.max_count,))
                total = db.execute("select coalesce(sum(size), 0) from responses").fetchone()[0]
                if total > self.max_bytes:  # oldest first, until the rest fits
                    db.execute(
                        "delete from responses where id in (select id from (select id, "
                        "sum(size) over (order by created desc) as running from responses) "
                        "where running > ?)", (self.max_bytes,))

        try:
            await self._run(write)
        except sqlite3.Error as e:  # locked by another process, a full disk...
            log.warning("could not store response %s now (%s); it is kept in memory and "
                        "written again in the background", rid, e)
            self._unwritten[rid] = (pending.owner, Stored(
                response, pending.input_items, pending.conversation))
            t = asyncio.get_running_loop().create_task(self._write_later(rid, write))
            self._retries.add(t)
            t.add_done_callback(self._retries.discard)

    async def _write_later(self, rid: str, write: Callable[[sqlite3.Connection], Any]
                           ) -> None:
        for _ in range(_RETRIES):
            await asyncio.sleep(1.0)
            if rid not in self._unwritten:
                return  # deleted meanwhile
            try:
                await self._run(write)
            except sqlite3.Error:
                continue
            self._unwritten.pop(rid, None)
            log.info("stored response %s", rid)
            return
        log.error("response %s could not be stored: the database refused it for %d s",
                  rid, _RETRIES)

    # ---- the request path ------------------------------------------------

    def new_id(self) -> str:
        hexid = uuid.uuid4().hex[:24]
        return f"resp_{hexid}_{self.node}" if self.node else f"resp_{hexid}"

    async def find(self, rid: str, owner: str) -> Optional[Stored]:
        """This node's response, or in a fleet, the one its node stored."""
        s = await self.get(rid, owner)
        node = node_of(rid)
        if s is None and node and node != self.node and self.remote is not None:
            got = await self.remote(node, "GET", rid, owner)
            if got is not None:
                s = Stored(got["response"], got["input_items"], got["conversation"])
        return s

    async def prepare(self, body: dict[str, Any], owner: str
                      ) -> tuple[dict[str, Any], Pending]:
        """The body to send (history expanded, the response's id chosen) and what to
        store afterwards."""
        own = _items(body.get("input"))
        prev_id = body.get("previous_response_id")
        history: list[dict[str, Any]] = []
        body = {**body, RESPONSE_ID_FIELD: self.new_id()}
        if prev_id is not None:
            prev = await self.find(prev_id, owner) if isinstance(prev_id, str) else None
            if prev is None:
                raise APIError(404, f"Previous response with id '{prev_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found",
                               type="invalid_request_error")
            history = prev.conversation + [dict(o) for o in prev.response.get("output", [])]
            body.update({"input": history + own, HISTORY_FIELD: True})
        return body, Pending(own, history + own, owner)

    async def capture(self, content: bytes, pending: Pending) -> None:
        """Store a non-streamed answer (before it is sent)."""
        try:
            resp = json.loads(content)
        except ValueError:
            return
        if isinstance(resp, dict) and resp.get("object") == "response":
            await self.put(resp, pending)

    async def capture_stream(self, chunks: AsyncIterator[bytes], pending: Pending
                             ) -> AsyncIterator[bytes]:
        """Relay a stream; the chunk that completes the final event is held until the
        response it carries is stored."""
        tail = b""
        stored = False
        async for chunk in chunks:
            if not stored:
                tail = (tail + chunk)[-(1 << 22):]  # the final event, at most 4 MiB of it
                resp = _final_response(tail)
                if resp is not None:
                    stored = True
                    await self.put(resp, pending)
            yield chunk


def _final_response(tail: bytes) -> Optional[dict[str, Any]]:
    """The response of a complete ``response.completed`` / ``.incomplete`` event."""
    for kind in (b"event: response.completed\n", b"event: response.incomplete\n"):
        at = tail.rfind(kind)
        if at < 0:
            continue
        line, sep, _ = tail[at + len(kind):].partition(b"\n")
        if not sep or not line.startswith(b"data: "):
            return None  # not all there yet
        try:
            resp = json.loads(line[6:])["response"]
        except (ValueError, KeyError, TypeError):
            return None
        return resp if isinstance(resp, dict) else None
    return None


def register_responses(app: Quart, store: ResponseStore, has_keys: bool) -> None:
    def _owner() -> str:
        return owner_of(request.headers, has_keys, getattr(g, "forwarded_by", None) is not None)

    async def find(rid: str) -> Stored:
        s = await store.find(rid, _owner())
        if s is None:
            raise APIError(404, f"No response found with id '{rid}'.", param="response_id",
                           code="response_not_found", type="invalid_request_error")
        return s

    @app.get("/v1/responses/<rid>")
    async def get_response(rid: str):
        s = await find(rid)
        if getattr(g, "forwarded_by", None) is not None:  # another node asks: all of it
            return {"response": s.response, "input_items": s.input_items,
                    "conversation": s.conversation}
        return s.response

    @app.delete("/v1/responses/<rid>")
    async def delete_response(rid: str):
        owner = _owner()
        node = node_of(rid)
        if node and node != store.node and store.remote is not None:
            if await store.remote(node, "DELETE", rid, owner) is None:
                await find(rid)  # the 404
        elif not await store.delete(rid, owner):
            await find(rid)
        return {"id": rid, "object": "response", "deleted": True}

    @app.get("/v1/responses/<rid>/input_items")
    async def input_items(rid: str):
        items = list((await find(rid)).input_items)
        if request.args.get("order", "desc") == "desc":
            items.reverse()
        try:
            limit = max(1, min(100, int(request.args.get("limit", 20))))
        except ValueError:
            raise APIError(400, "limit must be an integer from 1 to 100.", param="limit",
                           code="invalid_value") from None
        after = request.args.get("after")
        if after:
            ids = [i.get("id") for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit}
