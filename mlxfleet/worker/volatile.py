"""Volatile prompt fragments: text some clients put in every request that changes from
request to request and means nothing to the model, so it would defeat the prompt cache.

Claude Code's first system block is ``x-anthropic-billing-header: cc_version=2.1.332.a3f;
cc_entrypoint=cli; ...``: the suffix of ``cc_version`` is a hash of the prompt, so every
new session (every ``claude -p``, as CI and scripts run it) differed from the last one in
its very first tokens and reused 38 of ~49,000 (exo measured 0.2% -> 98.5% hits after
removing it; Ollama removes it too). Such a fragment is removed from system and developer
messages before the chat template renders them: the cache then keys on what the model
actually needs to read. ``FRAGMENTS`` lists them per client; a manifest adds its own with
``spec.cache.volatile`` (regular expressions, multi-line mode).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fragment:
    client: str
    pattern: str  # a regular expression (re.MULTILINE): what is removed
    why: str


FRAGMENTS: tuple[Fragment, ...] = (
    Fragment("Claude Code", r"^x-anthropic-billing-header:[^\n]*(?:\n|$)",
             "a billing line whose cc_version ends in a hash of the prompt"),
)

#: The roles whose text is cleaned: where clients put their metadata.
_ROLES = frozenset({"system", "developer"})


class Steadier:
    """Removes the volatile fragments (``FRAGMENTS`` and ``extra`` patterns) from a
    conversation's system and developer text."""

    def __init__(self, extra: tuple[str, ...] = ()):
        self.pattern = re.compile("|".join(f"(?:{p})" for p in
                                           [f.pattern for f in FRAGMENTS] + list(extra)),
                                  re.MULTILINE)

    def text(self, text: str) -> str:
        return self.pattern.sub("", text) if text else text

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            if m.get("role") in _ROLES:
                content = m.get("content")
                if isinstance(content, str):
                    m = {**m, "content": self.text(content)}
                elif isinstance(content, list):
                    m = {**m, "content": [
                        {**p, "text": self.text(p["text"])}
                        if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                        for p in content]}
            out.append(m)
        return out
