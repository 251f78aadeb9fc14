"""Names clients, files, hubs and peers give us: one validator per kind, used everywhere
that kind of name enters (manifests, apply, ``/api/create``, ``/api/copy``, ``/api/pull``,
the store), and one way to put any client string into a log line.

Names are ASCII, checked whole (``\\A...\\Z``: ``$`` would accept a final newline), and
must already be in NFKC form: a full-width ``ｔｉｎｙ``, a zero-width space or a soft hyphen
inside ``tiny``, or a Cyrillic ``і`` would otherwise give two models that display the
same. A leaf: it imports nothing of ours.
"""

from __future__ import annotations

import re
import unicodedata

#: A model's ``metadata.name``: a DNS-1123 label (it is also a file name and a folder).
MODEL_NAME = re.compile(r"\A[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\Z")
#: An alias: what clients send as ``model`` (``gpt-4o-mini``, ``qwen3:8b``,
#: ``org/model``, ``claude-*`` as a glob).
ALIAS = re.compile(r"\A[A-Za-z0-9*?\[][A-Za-z0-9._:/@+*?\[\]!-]{0,127}\Z")
#: A Hugging Face repo id as the hub allows it (huggingface_hub's validate_repo_id).
REPO_ID = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}\Z")
#: A git commit id (a pinned revision, a snapshot folder).
COMMIT = re.compile(r"\A[0-9a-f]{40}\Z")
#: A blob in a Hugging Face cache: a SHA-256 (LFS files) or a git object id.
BLOB = re.compile(r"\A(?:[0-9a-f]{64}|[0-9a-f]{40})\Z")


def _odd_character(value: str) -> str:
    """Why ``value`` is not plain ASCII, naming the first odd character."""
    for c in value:
        if not c.isascii() or not c.isprintable():
            name = unicodedata.name(c, "a control character")
            return f"U+{ord(c):04X} ({name})"
    return ""


def _check(value: object, pattern: re.Pattern, what: str, rule: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string")
    odd = _odd_character(value)
    if odd or unicodedata.normalize("NFKC", value) != value:
        raise ValueError(f"{what} {loggable(value)} has {odd or 'characters outside NFKC'}: "
                         f"{rule}")
    if not pattern.match(value):
        raise ValueError(f"{what} {loggable(value)} is not valid: {rule}")
    return value


def model_name(value: object) -> str:
    """A model's name, or ValueError saying what is wrong with it."""
    return _check(value, MODEL_NAME, "name", "a lowercase DNS label: a-z, 0-9 and '-', "
                  "starting and ending with a letter or digit, at most 63 characters")


def alias(value: object) -> str:
    """An alias (or an alias pattern), or ValueError."""
    v = _check(value, ALIAS, "alias", "1-128 ASCII letters, digits and . _ : / @ + -, "
               "or a glob (* ? [...])")
    if ".." in v:
        raise ValueError(f"alias {loggable(v)} may not contain '..'")
    return v


def repo_id(value: object) -> str:
    """A Hugging Face repo id (``owner/name``), or ValueError."""
    v = _check(value, REPO_ID, "repo id", "owner/name, each 1-96 letters, digits, '.', "
               "'_' or '-', starting with a letter or digit")
    if ".." in v or "--" in v or v.endswith(".git"):
        raise ValueError(f"repo id {loggable(v)} may not contain '..' or '--' or end in .git")
    return v


def is_blob(value: object) -> bool:
    return isinstance(value, str) and BLOB.match(value) is not None


def loggable(value: object, limit: int = 200) -> str:
    """Any string a client sent, safe for one log line: quoted, control and non-ASCII
    characters escaped (a newline cannot forge a line), at most ``limit`` characters
    (a 30 MB model name logs 200)."""
    text = value if isinstance(value, str) else repr(value)
    cut = len(text) > limit
    out = ascii(text[:limit])
    return out + f"...(+{len(text) - limit} chars)" if cut else out
