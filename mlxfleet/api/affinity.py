"""Which conversation a request continues: the key that routes it to the copy of a
replicated model holding its prefix (``supervisor/replicas.py``).

The client's own session hints first, in the order they are most specific: OpenAI's
``prompt_cache_key`` (Codex sends its conversation id there), Anthropic's
``metadata.user_id`` (Claude Code puts its session in it), a session header (Claude
Code's ``X-Claude-Code-Session-Id``, Codex's ``session_id``), OpenAI's ``user``. Without
any, a hash of the prompt's opening (the system prompt or instructions and the first
two messages): the turns of one conversation share it, two conversations of one agent
differ in their first user message.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

#: The key, as the routing node worked it out, on a request it forwards to a copy.
AFFINITY_HEADER = "x-mlxfleet-affinity"
SESSION_HEADERS = ("x-claude-code-session-id", "session_id", "x-session-id",
                   "conversation_id")
_OPENING = 4096  # characters of the opening hashed


def affinity_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> str:
    """The request's affinity key (a short string; never empty)."""
    hint = body.get("prompt_cache_key")
    if isinstance(hint, str) and hint:
        return "cache:" + hint[:256]
    meta = body.get("metadata")
    if isinstance(meta, Mapping) and isinstance(meta.get("user_id"), str) and meta["user_id"]:
        return "meta:" + meta["user_id"][:256]
    for h in SESSION_HEADERS:
        if headers.get(h):
            return "session:" + headers[h][:256]
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user:" + user[:256]
    opening: list[Any] = [body.get("system"), body.get("instructions")]
    for field in ("messages", "input"):
        items = body.get(field)
        if isinstance(items, list):
            opening.extend(items[:2])
        elif isinstance(items, str):
            opening.append(items)
    if isinstance(body.get("prompt"), str):
        opening.append(body["prompt"])
    text = json.dumps(opening, sort_keys=True, default=str)[:_OPENING]
    return "prefix:" + hashlib.sha256(text.encode()).hexdigest()[:24]
