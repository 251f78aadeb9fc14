"""The Responses API's state, kept by the gateway: stored responses and
``previous_response_id``.

Workers are stateless formatters (``worker/responses.py``); this module keeps
finished responses in memory, bounded by count, bytes and age, answers ``GET``
and ``DELETE /v1/responses/{id}`` and ``GET .../input_items``, and turns
``previous_response_id`` into the whole conversation sent as ``input`` (the
worker's prompt cache makes that resend cheap). Responses created with
``store: false`` are not kept.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

from quart import Quart, request

from ..wire import HISTORY_FIELD, APIError


@dataclass
class Stored:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]  # this request's own input (for input_items)
    conversation: list[dict[str, Any]]  # everything the model saw as input
    size: int
    at: float = field(default_factory=time.monotonic)


@dataclass
class Pending:
    """A request on its way to a worker: what to store once its response is known."""

    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]


def _items(inp: Any) -> list[dict[str, Any]]:
    """``input`` as a list of items, each with an id (as OpenAI lists them)."""
    items = [{"type": "message", "role": "user", "content": inp}] if isinstance(inp, str) \
        else [dict(i) for i in inp if isinstance(i, dict)] if isinstance(inp, list) else []
    for it in items:
        it.setdefault("id", f"msg_{uuid.uuid4().hex[:24]}")
    return items


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int, ttl: float):
        self.max_count, self.max_bytes, self.ttl = max_count, max_bytes, ttl
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def get(self, rid: str) -> Optional[Stored]:
        self._expire()
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        s = self._items.pop(rid, None)
        if s is not None:
            self.bytes -= s.size
        return s is not None

    def put(self, response: dict[str, Any], pending: Pending) -> None:
        rid = response.get("id")
        if not isinstance(rid, str) or response.get("store") is False:
            return
        s = Stored(response, pending.input_items, pending.conversation, 0)
        s.size = len(json.dumps([response, pending.conversation]))
        if s.size > self.max_bytes:
            return
        self.delete(rid)
        self._items[rid] = s
        self.bytes += s.size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            self.delete(next(iter(self._items)))

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl
        while self._items:
            first = next(iter(self._items.values()))
            if first.at >= cutoff:
                break
            self.delete(first.response["id"])

    # ---- the request path ------------------------------------------------

    def prepare(self, body: dict[str, Any]) -> tuple[dict[str, Any], Pending]:
        """The body to send (history expanded) and what to store afterwards."""
        own = _items(body.get("input"))
        prev_id = body.get("previous_response_id")
        history: list[dict[str, Any]] = []
        if prev_id is not None:
            prev = self.get(prev_id) if isinstance(prev_id, str) else None
            if prev is None:
                raise APIError(404, f"Previous response with id '{prev_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found",
                               type="invalid_request_error")
            history = prev.conversation + [dict(o) for o in prev.response.get("output", [])]
            body = {**body, "input": history + own, HISTORY_FIELD: True}
        return body, Pending(own, history + own)

    def capture(self, content: bytes, pending: Pending) -> None:
        """Store a non-streamed answer."""
        try:
            resp = json.loads(content)
        except ValueError:
            return
        if isinstance(resp, dict) and resp.get("object") == "response":
            self.put(resp, pending)

    async def capture_stream(self, chunks: AsyncIterator[bytes], pending: Pending
                             ) -> AsyncIterator[bytes]:
        """Relay a stream unchanged; store the response its last event carries."""
        tail = b""
        async for chunk in chunks:
            yield chunk
            tail = (tail + chunk)[-(1 << 22):]  # the final event, at most 4 MiB of it
        for kind in (b"event: response.completed\n", b"event: response.incomplete\n"):
            at = tail.rfind(kind)
            if at >= 0:
                data = tail[at + len(kind):].split(b"\n", 1)[0]
                if data.startswith(b"data: "):
                    try:
                        self.put(json.loads(data[6:])["response"], pending)
                    except (ValueError, KeyError, TypeError):
                        pass
                return


def register_responses(app: Quart, store: ResponseStore) -> None:
    def find(rid: str) -> Stored:
        s = store.get(rid)
        if s is None:
            raise APIError(404, f"No response found with id '{rid}'.", param="response_id",
                           code="response_not_found", type="invalid_request_error")
        return s

    @app.get("/v1/responses/<rid>")
    async def get_response(rid: str):
        return find(rid).response

    @app.delete("/v1/responses/<rid>")
    async def delete_response(rid: str):
        find(rid)
        store.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}

    @app.get("/v1/responses/<rid>/input_items")
    async def input_items(rid: str):
        items = list(find(rid).input_items)
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
