"""Constrained decoding with llguidance, as a per-sequence logits processor in the batch.

llguidance's own ``llguidance.mlx`` helper needs Metal, so we apply its token
bitmask ourselves with numpy + ``mx.where``; that works on CPU and Metal alike.
Everything here that touches MLX runs on the engine thread. A grammar is compiled
once, when the request is validated, in a thread of its own (llguidance releases the
GIL) and within llguidance's resource limits, then tried along the path the closer
would take: a schema the engine cannot hold is a 400 before anything is queued, and
each sequence's processor starts from a copy of the compiled matcher.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

_tokenizers: dict[int, Any] = {}
#: Cost of the constraint, for the worker's status (engine thread only).
STATS = {"mask_seconds": 0.0, "steps": 0}


def ll_tokenizer(tokenizer: Any, vocab_size: int):
    """llguidance's view of the tokenizer (built once per worker: ~1 s for large vocabs)."""
    key = id(tokenizer)
    if key not in _tokenizers:
        import llguidance.hf

        _tokenizers[key] = llguidance.hf.from_tokenizer(
            tokenizer._tokenizer, n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_token_ids))
    return _tokenizers[key]


class GrammarError(ValueError):
    pass


#: The largest JSON schema taken, serialized (a forced tool call over a coding agent's
#: tools is tens of kilobytes); larger ones are a 400 before anything is compiled.
MAX_SCHEMA_BYTES = 512 * 1024


def _matcher(grammar: str, tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's matcher for ``grammar`` (JSON or Lark), within its default resource
    limits; its errors do not echo the grammar back to the client. It never raises: a
    grammar it cannot hold leaves the matcher in its error state."""
    import llguidance

    return llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab_size), grammar, log_level=0,
                                limits=llguidance.LLParserLimits(verbose_errors=False))


def _compiled(grammar: str, tokenizer: Any, vocab_size: int) -> Any:
    """``_matcher``, or GrammarError when llguidance cannot compile ``grammar``."""
    m = _matcher(grammar, tokenizer, vocab_size)
    if m.is_error():
        raise GrammarError(m.get_error())
    return m


def check_schema(schema: Any) -> None:
    """Refusals that need no compiling: too large, or no finite value satisfies it."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are "
                           "accepted")
    if not _has_finite_value(schema):
        raise GrammarError("no finite JSON value satisfies this schema (a required "
                           "property or item refers back to itself with no way out), so "
                           "an answer could never be complete")


def _has_finite_value(root: dict[str, Any]) -> bool:
    """Whether some finite JSON value can satisfy ``root``, as a least fixpoint over its
    ``$ref``s: each reference starts out 'no finite value' and becomes 'yes' once one of
    its ways out is found (a recursive required property never does). Keywords that only
    narrow values of a kind (patterns, bounds) are not judged: the grammar engine is."""
    refs: set[str] = set()

    def collect(s: Any) -> None:
        if isinstance(s, dict):
            if isinstance(s.get("$ref"), str):
                refs.add(s["$ref"])
            for v in s.values():
                collect(v)
        elif isinstance(s, list):
            for v in s:
                collect(v)

    def resolve(ref: str) -> Any:
        if not ref.startswith("#"):
            return True  # an outside reference: llguidance will say what it makes of it
        node: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return True  # a bad pointer is the compiler's error to report
        return node

    collect(root)
    known = dict.fromkeys(refs, False)

    def finite(s: Any) -> bool:
        if s is False:
            return False
        if not isinstance(s, dict):
            return True
        if isinstance(s.get("$ref"), str) and not known.get(s["$ref"], True):
            return False
        if isinstance(s.get("allOf"), list) and not all(finite(x) for x in s["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and not any(finite(x) for x in s[key]):
                return False  # (an empty list allows nothing)
        if "const" in s or "enum" in s:
            return True
        kinds = s.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) \
            else None
        if kinds is not None and any(k not in ("object", "array") for k in kinds):
            return True  # a scalar is always a way out
        if (kinds is None or "object" in kinds) and isinstance(s.get("required"), list):
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            extra = s.get("additionalProperties", True)
            if not all(finite(props.get(p, extra)) for p in s["required"]
                       if isinstance(p, str)):
                return kinds is not None and "array" in kinds and _array_ok(s)
        if kinds is not None and "array" in kinds and "object" not in kinds:
            return _array_ok(s)
        return True

    def _array_ok(s: dict[str, Any]) -> bool:
        need = s.get("minItems", 0)
        if not isinstance(need, int) or need <= 0:
            return True
        prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
        if not all(finite(x) for x in prefix[:need]):
            return False
        return need <= len(prefix) or finite(s.get("items", True))

    changed = True
    while changed:
        changed = False
        for ref in refs:
            if not known[ref] and finite(resolve(ref)):
                known[ref] = changed = True
    return finite(root)


def json_schema_grammar(schema: dict[str, Any]) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(
        # At most one space after separators: what models learned from json.dumps, and
        # no room for a random-weight model to loop on whitespace forever.
        json.dumps(schema), defaults={"whitespace_flexible": False, "whitespace_pattern": " ?"})


def tool_call_schema(tools: list[dict[str, Any]], name: Optional[str] = None) -> dict[str, Any]:
    """A JSON schema for ``{"name": ..., "arguments": {...}}`` over the declared tools.

    Each tool's parameters move to ``$defs/tool{i}`` of the new root, and their own
    references (``#``, ``#/$defs/node``: written against the parameters as root) are
    rewritten to point there, so recursive tool schemas keep working."""
    options, defs = [], {}
    for i, t in enumerate(tools):
        fn = t.get("function", t)
        if name is not None and fn.get("name") != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        if _has_refs(params):
            defs[f"tool{i}"] = _rebase(params, f"#/$defs/tool{i}")
            params = {"$ref": f"#/$defs/tool{i}"}
        options.append({"type": "object", "properties": {
            "name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False})
    if not options:
        raise GrammarError(f"tool_choice names '{name}', which is not among the declared tools")
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


def _has_refs(s: Any) -> bool:
    if isinstance(s, dict):
        return isinstance(s.get("$ref"), str) or any(_has_refs(v) for v in s.values())
    return isinstance(s, list) and any(_has_refs(v) for v in s)


def _rebase(s: Any, base: str) -> Any:
    """``s`` with every local ``$ref`` (``#...``) prefixed by ``base``."""
    if isinstance(s, dict):
        out = {k: _rebase(v, base) for k, v in s.items()}
        ref = s.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(s, list):
        return [_rebase(v, base) for v in s]
    return s


class Grammar:
    """A compiled grammar: its text, which is what travels to a sharded model's other
    ranks (pickled; they compile it again), and llguidance's matcher."""

    def __init__(self, text: str, matcher: Any = None, min_tokens: int = 0,
                 closes: bool = True):
        self.text, self.matcher = text, matcher
        #: JSON: the closer completes the value within max_tokens (Lark: no closer)
        self.closes = closes
        #: the tokens of the shortest complete value the closer found (0: not known)
        self.min_tokens = min_tokens

    def __getstate__(self) -> dict:
        return {"text": self.text, "closes": self.closes}

    def __setstate__(self, state: dict) -> None:
        self.text, self.matcher, self.min_tokens = state["text"], None, 0
        self.closes = state.get("closes", True)

    def start(self, tokenizer: Any, vocab_size: int) -> Any:
        """A fresh matcher for one sequence."""
        if self.matcher is None:
            self.matcher = _matcher(self.text, tokenizer, vocab_size)
        return self.matcher.deep_copy()


def schema_grammar(schema: Any, tokenizer: Any, vocab_size: int) -> Grammar:
    """A JSON schema -> its compiled ``Grammar``, or GrammarError saying why not."""
    check_schema(schema)
    text = json_schema_grammar(schema)
    return Grammar(text, *compile_grammar(text, tokenizer, vocab_size))


def lark_grammar(lark: str, tokenizer: Any, vocab_size: int) -> Grammar:
    """A Lark grammar (a freeform tool's, e.g. Codex's ``apply_patch``) -> ``Grammar``."""

    if len(lark) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the grammar is {len(lark)} bytes; at most {MAX_SCHEMA_BYTES}")
    return Grammar(lark, _compiled(lark, tokenizer, vocab_size), closes=False)


def compile_grammar(grammar: str, tokenizer: Any, vocab_size: int) -> tuple[Any, int]:
    """The compiled matcher and the length of the shortest value the closer finds (0
    when it finds none within its horizon), or GrammarError if llguidance cannot compile
    ``grammar`` within its limits, or fails along the way the closer would complete a
    value (a regex whose lexer only blows up once a string opens, say). Not on the
    engine thread, and not on the event loop: it can take a second."""
    m = _compiled(grammar, tokenizer, vocab_size)
    trial = m.deep_copy()
    vocab = _Vocab.of(tokenizer, vocab_size)
    plan = _closing_tokens(trial, vocab, START, vocab_size, set(tokenizer.eos_token_ids),
                           TRIAL_HORIZON)
    if trial.is_error():
        raise GrammarError(trial.get_error())
    if not trial.is_accepting():
        raise GrammarError(f"no complete value of this schema was found within "
                           f"{TRIAL_HORIZON} tokens, so an answer could not be guaranteed "
                           "to parse")
    return m, len(plan)


#: Bytes that can change JSON structure (open or close a string, object or array).
_STRUCTURAL = frozenset(b'"{}[],:\\')
#: Structure that always belongs on the way out (a comma means another item: not these).
_ACTING = frozenset(b'"{}[]:')
#: Bytes a closing token may consist of (structure and spaces; digits and literals are
#: added one by one: a large vocabulary has thousands of number tokens).
_CLOSER_BYTES = frozenset(b'"{}[],: ')
_LITERALS = (b"true", b"false", b"null")
#: How far from the budget the closer starts planning (and the longest close it plans).
CLOSE_HORIZON = 48
#: Up to this many allowed tokens, the closer checks each one's way out, not only those
#: that add structure.
FEW_CHOICES = 16
#: Tokens of slack kept between the closing plan and the budget.
CLOSE_SLACK = 4
#: The longest shortest value a schema may have (found by the closer when compiling).
TRIAL_HORIZON = 256


#: A JSON scanner's state: (open containers, in a string, after a backslash, a key or
#: value is expected, UTF-8 continuation bytes still due). Enough to tell which tokens
#: move towards a closed value.
Scan = tuple[str, bool, bool, bool, int]
START: Scan = ("", False, False, True, 0)


def scan(state: Scan, data: bytes) -> Scan:
    stack, in_str, esc, expecting, due = state
    for b in data:
        if b >= 0x80:  # multi-byte characters: a string cannot close mid-character
            due = due - 1 if b < 0xC0 and due else (1 if b < 0xE0 else 2 if b < 0xF0 else 3)
            continue
        due = 0
        c = chr(b)
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str, expecting = True, False
        elif c in "{[":
            stack, expecting = stack + c, True
        elif c in "}]":
            stack, expecting = stack[:-1], False
        elif c in ",:":
            expecting = True
        elif not c.isspace():
            expecting = False  # a number or a literal
    return stack, in_str, esc, expecting, due


def distance(state: Scan) -> int:
    """How far a scanner state is from a closed value (lower is closer)."""
    stack, in_str, _, expecting, due = state
    return 3 * len(stack) + 2 * in_str + expecting + (due > 0)


def _closing_score(state: Scan, text: bytes) -> tuple[int, int, Scan]:
    """How far ``text`` leaves a completion (lower is better: closer to a closed value,
    with more structure per token, so ``":`` ties ``"`` after a key; bare whitespace
    counts against), the bytes it writes inside strings, and the state after."""
    acting = filler = 0
    st = state
    for b in text:
        nxt = scan(st, bytes([b]))
        if st[1] and nxt[1]:
            filler += 1  # written inside a string
        elif b in _ACTING:
            acting += 1  # a quote, bracket or colon that does its job
        st = nxt
    waste = 2 if not text.strip() else 0
    return distance(st) + waste - acting, filler, st


def _opens(state: Scan, text: bytes, here: int) -> bool:
    """Whether ``text`` adds work: deeper structure, a comma (another item or key), or
    a colon (the key's value is due, and its schema may make it long: a pattern)."""
    st = state
    for b in text:
        if b in b",:" and not st[1]:
            return True
        st = scan(st, bytes([b]))
    return distance(st) > here


class _Vocab:
    """Each token's bytes, which tokens can change JSON structure, and the short tokens
    the closer tries first (built once per tokenizer)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        import numpy as np

        ll = ll_tokenizer(tokenizer, vocab_size)
        self.texts = [ll.decode_bytes([i]) for i in range(vocab_size)]
        self.structural = np.array([any(b in _STRUCTURAL for b in t) for t in self.texts])
        self.closers = np.array([i for i, t in enumerate(self.texts) if t and len(t) <= 8 and (
            all(b in _CLOSER_BYTES for b in t)
            or t.strip() in _LITERALS or (t.strip().isdigit() and len(t.strip()) == 1))],
            dtype=np.int64)
        #: tokens that close a string (a quote and what may follow it)
        self.quotes = np.array([i for i, t in enumerate(self.texts) if t[:1] == b'"'
                                and len(t) <= 4], dtype=np.int64)
        #: one printable byte each: what a string pattern is spelled with
        self.single = [i for i, t in enumerate(self.texts) if len(t) == 1 and 32 <= t[0] < 127]
        self.quote = self.texts.index(b'"') if b'"' in self.texts else None
        self._scores: dict[tuple[Scan, int], tuple[int, int, Scan]] = {}

    def score(self, state: Scan, token: int) -> tuple[int, int, Scan]:
        """``_closing_score`` of a token, remembered (states repeat across requests)."""
        key = (state, token)
        got = self._scores.get(key)
        if got is None:
            if len(self._scores) > 500_000:
                self._scores.clear()
            got = self._scores[key] = _closing_score(state, self.texts[token])
        return got

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int) -> _Vocab:
        key = id(tokenizer)
        if key not in _vocabs:
            _vocabs[key] = cls(tokenizer, vocab_size)
        return _vocabs[key]


_vocabs: dict[int, _Vocab] = {}


#: Filler tokens the closer tries ahead, looking for one after which the string can end.
LOOKAHEAD = 8


def _pick(state: Scan, cand: list[int], vocab: _Vocab, m: Any = None,
          deep: Optional[list[int]] = None) -> int:
    """The closer's next token: the best score, never one that comes back to the same
    state (``", "`` in an array: one more item, no progress); filler inside a string
    only as much as the grammar insists on (a minLength, an enum: then the longest),
    and preferably filler after which the string may close (a pattern to satisfy:
    ``deep`` counts the searches two bytes ahead this plan may still make)."""
    scored = []
    for t in cand:
        score, filler, after = vocab.score(state, t)
        if after == state and score < distance(state) + 2 and len(cand) > 1 and filler == 0:
            continue
        scored.append((score, filler, -len(vocab.texts[t]), t))
    if not scored:
        return cand[0]
    if all(f for _, f, _, _ in scored):  # filler is needed: the most per token
        ranked = sorted(scored, key=lambda x: (x[0], -x[1], x[2], x[3]))
        if m is not None:
            quotes = vocab.quotes
            for *_, t in ranked[:LOOKAHEAD]:
                trial = m.deep_copy()
                trial.consume_token(t)
                bits = GrammarProcessor._allowed(trial, len(vocab.texts))
                if bits[quotes[quotes < bits.size]].any():
                    return t
            if deep and deep[0] > 0:
                step = _spell_to_close(m, state, vocab)
                if step is not None:
                    return step
                deep[0] -= 1  # a failed search costs ~10k checks: not at every token
        return ranked[0][3]
    return min(scored)[3]


def _spell_to_close(m: Any, state: Scan, vocab: _Vocab) -> Optional[int]:
    """The first of one or two printable bytes after which the open string may end
    (``"pattern": "11"`` wants both 1s before its quote; the closer's short tokens
    rarely spell it). ``validate_tokens`` checks a path without consuming it."""
    q = vocab.quote
    if q is None:
        return None

    def closes(path: list[int]) -> bool:
        if m.validate_tokens([*path, q]) != len(path) + 1:
            return False
        return not scan(state, b"".join(vocab.texts[t] for t in path) + b'"')[1]

    for path in ([a] for a in vocab.single):
        if closes(path):
            return path[0]
    for a in vocab.single:
        if m.validate_tokens([a]) == 1 and any(closes([a, b]) for b in vocab.single):
            return a
    return None


class GrammarProcessor:
    """mlx_lm logits processor: masks every token the grammar does not allow next.

    With a token budget (``max_tokens``) the output also always completes: in the last
    ``CLOSE_HORIZON`` tokens the closer plans a short way to a complete value (greedily:
    closing quotes and brackets first, forced keys, the smallest values), masks out
    tokens after which that plan would no longer fit, and once the plan needs what is
    left, the sequence follows it (``forced_close``: the answer ends for ``length``).
    llguidance enforces validity but has no notion of a budget; this is that notion.

    ``tokens`` is the sequence so far (prompt, then each generated token as it is
    fed back); the first call sees only the prompt.
    """

    def __init__(self, grammar: Grammar, tokenizer: Any, vocab_size: int,
                 max_tokens: Optional[int] = None):
        self._m = grammar.start(tokenizer, vocab_size)  # compiled once, off this thread
        self._reach = max(CLOSE_HORIZON, grammar.min_tokens + CLOSE_SLACK + 2)
        self._eos = sorted(tokenizer.eos_token_ids)
        self._base: Optional[int] = None
        self._consumed = 0
        self._max_tokens = max_tokens
        self._vocab = _Vocab.of(tokenizer, vocab_size) if max_tokens else None
        self._scan = START
        self._plan: Optional[list[int]] = None  # closing mode: the tokens left to emit
        self.forced_close = False  # the budget, not the model, ended the value
        self.error: Optional[str] = None  # the grammar engine failed mid-way

    def __call__(self, tokens, logits):
        import mlx.core as mx

        t0 = time.perf_counter()
        n = tokens.shape[-1] if hasattr(tokens, "shape") else len(tokens)
        if self._base is None:
            self._base = n
        new = n - self._base - self._consumed
        if new > 0:
            for t in tokens[-new:].tolist():
                self._m.consume_token(int(t))
                if self._vocab is not None:
                    self._scan = scan(self._scan, self._vocab.texts[int(t)])
            self._consumed += new
        vocab = logits.shape[-1]
        bits = self._allowed(self._m, vocab)
        if self._vocab is not None and bits.any():
            bits = self._budget(bits, vocab)
        if self._m.is_error() and self.error is None:
            self.error = self._m.get_error()
        if not bits.any():  # grammar finished or failed: allow only end-of-sequence
            bits[[t for t in self._eos if t < vocab]] = True
        out = mx.where(mx.array(bits)[None, :], logits, -float("inf"))
        STATS["mask_seconds"] += time.perf_counter() - t0
        STATS["steps"] += 1
        return out

    @staticmethod
    def _allowed(m: Any, vocab: int):
        import numpy as np
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        bm = allocate_token_bitmask(1, vocab)
        fill_next_token_bitmask(m, bm)
        return np.unpackbits(bm.view(np.uint8), bitorder="little")[:vocab].astype(bool)

    def _budget(self, bits, vocab: int):
        """Narrow ``bits`` so the value is complete when the budget runs out."""
        import numpy as np

        left = self._max_tokens - self._consumed
        # Each open container costs a token or two to close: plan earlier when deep.
        horizon = self._reach + 2 * len(self._scan[0])
        if self._plan is None and left <= horizon and not self._m.is_accepting():
            plan = self._close_plan(vocab, self._m, self._scan, horizon)
            # Follow the plan a few tokens early: one free token (a key the schema makes
            # costly, say) can lengthen the way out by more than it uses.
            if len(plan) + 2 + CLOSE_SLACK >= left:
                self._plan = plan
                self.forced_close = True
            else:  # no token whose completion would no longer fit
                texts, here = self._vocab.texts, distance(self._scan)
                allowed = np.nonzero(bits)[0]
                # A choice among a few (keys, enum values) is checked whole: choosing a
                # key whose value has a pattern to meet costs more than its bytes show.
                few = allowed.size <= FEW_CHOICES
                for t in allowed if few else np.nonzero(bits & self._vocab.structural[:vocab])[0]:
                    t = int(t)
                    if not few and not _opens(self._scan, texts[t], here):
                        continue
                    m = self._m.deep_copy()
                    m.consume_token(t)
                    after = self._close_plan(vocab, m, scan(self._scan, texts[t]), horizon)
                    if len(after) + 2 >= left - 1 and bits.sum() > 1:
                        bits[t] = False
        if self._plan:
            t = self._plan.pop(0)
            bits = np.zeros(vocab, dtype=bool)
            bits[t] = True
        return bits

    def _close_plan(self, vocab: int, matcher: Any, state: Scan, horizon: int) -> list[int]:
        """The tokens of a greedy short completion from ``matcher`` (left untouched) in
        ``state``: at most ``horizon`` of them."""
        return _closing_tokens(matcher.deep_copy(), self._vocab, state, vocab,
                               set(self._eos), horizon)


def _closing_tokens(m: Any, vocab: _Vocab, state: Scan, size: int, eos: set[int],
                    horizon: int) -> list[int]:
    """Feed ``m`` a greedy short completion (at most ``horizon`` tokens); return it."""
    import numpy as np

    plan: list[int] = []
    closers = vocab.closers
    deep = [1]
    while len(plan) < horizon and not m.is_accepting():
        bits = GrammarProcessor._allowed(m, size)
        allowed = np.nonzero(bits)[0]
        if allowed.size == 0:
            break
        if allowed.size > 32:
            usable = closers[closers < size]
            cand = usable[bits[usable]]
            if cand.size == 0:
                cand = allowed[:64]
        else:
            cand = allowed
        cand = [int(t) for t in cand if int(t) not in eos]
        if not cand:
            break
        best = _pick(state, cand, vocab, m, deep)
        m.consume_token(best)
        state = scan(state, vocab.texts[best])
        plan.append(best)
    return plan
