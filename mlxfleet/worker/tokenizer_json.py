"""A checkpoint's tokenizer.json, read only as far as mlx-lm looks.

mlx-lm's tokenizer loader parses the whole tokenizer.json to read one small member,
``decoder``, which picks its streaming detokenizer. For a 262k vocabulary (Gemma) that
file is 33 MB: a second of ``json.load`` (and the UTF-8 decoding of it) on every
worker start, the model's on-demand load included. Serializers (tokenizers' Rust one,
which every hub checkpoint comes from) write ``decoder`` before the large ``model``
member, so reading the top-level members in order and stopping there reads a few
hundred kilobytes. A file that is laid out otherwise is parsed whole, as before: the
result is the same either way (the members read are parsed by the json module itself).

``quick_tokenizer_json()`` installs that reader where mlx-lm's loader finds ``json``,
for the duration of a load (the engine thread is the only one loading tokenizers).

It also lists a fast tokenizer's vocabulary once per load. transformers builds the
``get_vocab()`` dict anew from the Rust tokenizer on every call (0.1-0.2 s for 150-262k
ids), and a load asks for it three times (mlx-lm's thinking and marker detection, then the
worker's unknown-id mask); meanwhile each call gets a copy of the first one's, kept per
tokenizer and its length (which added tokens change).
"""

from __future__ import annotations

import codecs
import contextlib
import json
import re
import weakref
from collections.abc import Callable, Iterator
from json.decoder import scanstring
from typing import Any

_WS = re.compile(r"[ \t\n\r]*")
PREFIX_BYTES = 4 << 20  # read this much first; a member past it means the whole file


def leading_members(text: str, wanted: str) -> dict[str, Any] | None:
    """The top-level members of the JSON object that ``text`` begins, in order, up to and
    including ``wanted``; None when ``text`` ends (or stops being an object) first."""
    decoder = json.JSONDecoder()

    def skip(i: int) -> int:
        return _WS.match(text, i).end()

    i = skip(0)
    if text[i:i + 1] != "{":
        return None
    out: dict[str, Any] = {}
    i = skip(i + 1)
    while text[i:i + 1] == '"':
        key, i = scanstring(text, i + 1)
        i = skip(i)
        if text[i:i + 1] != ":":
            return None
        try:
            out[key], i = decoder.raw_decode(text, skip(i + 1))
        except json.JSONDecodeError:  # (a value cut off where the prefix ends)
            return None
        if key == wanted:
            return out
        i = skip(i)
        if text[i:i + 1] != ",":
            return None
        i = skip(i + 1)
    return None


def load_tokenizer_json(fp: Any) -> Any:
    """``json.load`` for mlx-lm's tokenizer loader: the members up to ``decoder`` of a
    file named tokenizer.json (all mlx-lm reads of it), any other file whole."""
    name = str(getattr(fp, "name", ""))
    if not name.endswith("tokenizer.json"):
        return json.load(fp)
    with open(name, "rb") as raw:
        head = raw.read(PREFIX_BYTES)
    # strict UTF-8, except that a character cut where the prefix ends waits (final=False)
    members = leading_members(codecs.getincrementaldecoder("utf-8")().decode(head), "decoder")
    return members if members is not None else json.load(fp)


class _JsonForMlxLm:
    """The ``json`` module, with ``load`` reading tokenizer.json only as far as needed."""

    load = staticmethod(load_tokenizer_json)

    def __getattr__(self, name: str) -> Any:
        return getattr(json, name)


def _vocab_once(get_vocab: Callable[[Any], dict[str, int]]) -> Callable[[Any], dict[str, int]]:
    """``get_vocab`` built once per tokenizer (and length), copied for each caller."""
    built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def once(tok: Any) -> dict[str, int]:
        size = len(tok)
        hit = built.get(tok)
        if hit is None or hit[0] != size:
            hit = built[tok] = (size, get_vocab(tok))
        return dict(hit[1])

    return once


@contextlib.contextmanager
def quick_tokenizer_json() -> Iterator[None]:
    """Meanwhile mlx-lm's tokenizer loader reads tokenizer.json only up to ``decoder``,
    and a fast tokenizer's vocabulary is listed once."""
    from mlx_lm import tokenizer_utils
    from transformers import PreTrainedTokenizerFast as Fast

    before, listed = tokenizer_utils.json, Fast.get_vocab
    tokenizer_utils.json = _JsonForMlxLm()
    Fast.get_vocab = _vocab_once(listed)
    try:
        yield
    finally:
        tokenizer_utils.json, Fast.get_vocab = before, listed
