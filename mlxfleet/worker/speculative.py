"""Speculative decoding inside continuous batching (engine thread only).

mlx-lm's ``BatchGenerator`` decodes one token per sequence per forward pass, and
mlx_lm.server turns batching off when it speculates. Here every running sequence may
carry a draft (prompt lookup: the tokens that followed the last earlier occurrence of
its last few tokens, in its prompt or its output so far, or in the prediction the client
sent); the whole batch's drafts are verified in one forward pass of ``[rows, 1 + k]``
tokens, each row keeps the tokens the model agrees with plus the model's own next token,
and each row's cache is cut back to what it kept.

mlx-lm's ``BatchKVCache`` has one write index for the batch (rows are left-padded), so
rows cannot be cut back by different amounts. The batch is cut back by the least any row
rejected; the rest of each row's rejected positions become more of its left padding
(what ``prepare(right_padding=...)``/``finalize()`` do, the roll mlx-lm itself uses after
a right-padded prefill; ``shift_right`` does it by whole vectors). Only caches that are
plain key/value buffers can be cut back like this: models with a sliding window or
recurrent state don't speculate (``unsupported``).

Whether a step speculates, and how wide, is chosen per step from what it is expected to
pay: each sequence's acceptance rate (also measured on drafts it did not send, so that
drafting resumes when it would pay again) against the measured cost of a forward pass
as a function of the tokens it reads (``StepCost``). Greedy rows are exact: a row emits
only tokens the model's argmax gives. Rows that sample keep the model's distribution by
standard speculative (rejection) sampling (``accept_sampled``). Rows with logits
processors (penalties, grammars) or a seed don't draft; they are decoded in the same
pass, one token each.

``Speculator.next`` takes the place of mlx-lm's ``GenerationBatch.next`` and touches the
batch's internals (``_next_tokens``, ``_num_tokens``, ``_matchers``...):
tests/test_mlx_lm_api.py fails when mlx-lm moves them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

#: The n-gram lengths prompt lookup matches, longest first.
NGRAM_MAX, NGRAM_MIN = 4, 2
#: A sequence's acceptance estimate before it has any evidence, and how fast it moves.
PRIOR_ACCEPT, ACCEPT_RATE = 0.5, 0.2
#: Speculate only when the expected tokens per second beat a plain step by this much.
MARGIN = 1.05
#: After this many steps without drafting, one step drafts anyway (2 tokens), to measure
#: again; the wait doubles after each probe, up to PROBE_MAX. With a draft model, whose
#: drafts cost a pass each (no free shadow drafts to judge), this measures acceptance;
#: with prompt lookup, what a wider step costs (see ``_probe``).
PROBE_EVERY, PROBE_MAX = 16, 1024
#: How fast the model-wide acceptance estimate (a new sequence's prior) moves.
MODEL_ACCEPT_RATE = 0.05


def unsupported(model: Any, sharded: bool, vision: bool) -> Optional[str]:
    """Why this model cannot speculate, or None."""
    from .model_facts import cache_kinds

    if sharded:
        return "a sharded model decodes one token per step on every rank"
    if vision:
        return "vision models decode one token per step"
    kinds = cache_kinds(model)
    if kinds not in (["KVCache"], ["QuantizedCache"]):
        return (f"its caches ({', '.join(kinds)}) cannot be cut back to a row's accepted "
                "length")
    return None


GREEDY, SAMPLED, PLAIN = "greedy", "sampled", "plain"


def _kind(gb: Any, i: int) -> str:
    """How row ``i`` of the batch verifies a draft: ``greedy`` (the argmax), ``sampled``
    (rejection sampling against its sampler's distribution), or ``plain``: it doesn't
    draft (logits processors depend on every token before; a seeded sampler must draw
    the same numbers however the steps fall)."""
    from mlx_lm.sample_utils import greedy_sampler

    if gb.logits_processors and gb.logits_processors[i]:
        return PLAIN
    s = _sampler(gb, i)
    if s is greedy_sampler:
        return GREEDY
    return SAMPLED if hasattr(s, "probs") else PLAIN


def _sampler(gb: Any, i: int) -> Any:
    """Row ``i``'s sampler (the batch's fallback where the row has none)."""
    s = gb.samplers[i] if gb.samplers else None
    return gb.fallback_sampler if s is None else s


def accept_sampled(probs: list, drafts: list[list[int]]) -> list[tuple[int, int]]:
    """Standard speculative sampling for drafts that are one token per position (prompt
    lookup: a draft's own distribution is all on its token), for several rows at once.
    ``probs[r]``: row r's target distribution at its draft's positions and one more,
    ``(len(drafts[r]) + 1, vocab)``. Each draft token is accepted with its target
    probability; at the first rejection the next token is drawn from the target with that
    token removed (renormalized), and after a draft accepted whole, from the next
    position's target. The output has the target's distribution exactly. Returns each
    row's (tokens accepted, the next token). All rows' draws are read in two evaluations:
    per row, each step waited on the device twice for every sampled row."""
    import mlx.core as mx

    hits: list[bool] = []
    if any(drafts):
        p = mx.concatenate([q[mx.arange(len(d)), mx.array(d)] for q, d in zip(probs, drafts)
                            if d])
        hits = (mx.random.uniform(shape=p.shape) < p).tolist()
    accepted, at = [], 0
    for d in drafts:
        n = 0
        while n < len(d) and hits[at + n]:
            n += 1
        accepted.append(n)
        at += len(d)
    nexts = []
    for q, d, n in zip(probs, drafts, accepted):
        row = q[n]
        if n < len(d):  # the residual: max(p - q, 0) with q all on the rejected token
            row = mx.where(mx.arange(row.shape[-1]) == d[n], 0, row)
        nexts.append(mx.random.categorical(mx.log(row)))
    return list(zip(accepted, mx.stack(nexts).tolist())) if nexts else []


class Lookup:
    """Prompt lookup over one token sequence: for each n-gram, where it last ended."""

    def __init__(self, tokens: list[int] = ()) -> None:
        self.tokens: list[int] = [int(t) for t in tokens]
        toks = self.tokens
        # What ``extend`` does token by token, built by dict and zip in C: a burst's 256
        # prompts of 280 tokens took the engine thread 0.26 s that way (a later n-gram's
        # end replaces an earlier one's in both).
        self._ends: dict[int, dict[tuple, int]] = {
            n: dict(zip(zip(*(toks[i:] for i in range(n))), range(n, len(toks))))
            for n in range(NGRAM_MIN, NGRAM_MAX + 1)}

    def extend(self, tokens) -> None:
        toks = self.tokens
        for t in tokens:
            toks.append(int(t))
            p = len(toks) - 1  # the n-grams ending just before p are followed by p
            for n, ends in self._ends.items():
                if p >= n:
                    ends[tuple(toks[p - n:p])] = p

    def follow(self, tail: list[int], k: int, pending: Optional[int] = None,
               own: bool = True) -> list[int]:
        """Up to ``k`` tokens that followed the last earlier occurrence of the longest
        matching end of ``tail``. ``own``: ``tail`` ends this same sequence (followed by
        ``pending`` when given), so a continuation that runs into the end goes on with
        the tokens it just predicted: text that repeats keeps its period."""
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            at = self._ends[n].get(tuple(tail[-n:])) if len(tail) >= n else None
            if at is None:
                continue
            if not own:
                return self.tokens[at:at + k]
            toks, size = self.tokens, len(self.tokens)
            end = size + (pending is not None)
            out: list[int] = []
            while len(out) < k:
                i = at + len(out)
                out.append(toks[i] if i < size else pending if i < end else out[i - end])
            return out
        return []


class Order:
    """Which of a row's positions each slot of its batched cache holds, once ``relocate``
    has moved some: slot j (counted from the row's left padding) holds position
    ``perm[j]``, kept as runs ``[first, count]`` of consecutive positions. Positions the
    cache gained since (decode steps) are the highest, in the last slots."""

    def __init__(self) -> None:
        self.runs: deque[list[int]] = deque()
        self.covered = 0  # positions the runs account for

    def _push(self, first: int, count: int) -> None:
        if self.runs and sum(self.runs[-1]) == first:
            self.runs[-1][1] += count
        else:
            self.runs.append([first, count])

    def _sync(self, n: int) -> None:
        if n > self.covered:
            self._push(self.covered, n - self.covered)
            self.covered = n

    def rotate(self, n: int, e: int) -> None:
        """The row's first ``e`` slots of its ``n`` moved after the last."""
        self._sync(n)
        while e:
            first, count = self.runs[0]
            take = min(e, count)
            if take == count:
                self.runs.popleft()
            else:
                self.runs[0] = [first + take, count - take]
            self._push(first, take)
            e -= take

    def slots(self, n: int) -> Optional[list[int]]:
        """The slot of each of the row's ``n`` positions in turn; None when they are in
        order."""
        self._sync(n)
        if len(self.runs) <= 1:
            return None
        out, j = [0] * n, 0
        for first, count in self.runs:
            out[first:first + count] = range(j, j + count)
            j += count
        return out


@dataclass
class Row:
    """One sequence's drafting state."""

    own: Lookup  # its prompt and output so far
    predicted: Optional[Lookup] = None  # the client's prediction of the output
    accept: float = PRIOR_ACCEPT  # estimated chance that a draft token is accepted
    # A draft it did not send, judged on the tokens that come instead: the pending token
    # it followed, then the draft.
    shadow: list[int] = field(default_factory=list)
    shadow_hits: int = 0
    order: Order = field(default_factory=Order)  # its cache's slots (``relocate``)

    def draft(self, k: int, pending: Optional[int] = None) -> list[int]:
        """Up to ``k`` tokens to follow the sequence (and ``pending``, its next token
        when known)."""
        return self.from_prediction(k, pending) or self.own.follow(
            self._tail(pending), k, pending)

    def from_prediction(self, k: int, pending: Optional[int] = None) -> list[int]:
        """Up to ``k`` tokens the client's prediction has after the sequence's end."""
        if self.predicted is None:
            return []
        return self.predicted.follow(self._tail(pending), k, own=False)

    def _tail(self, pending: Optional[int]) -> list[int]:
        toks = self.own.tokens
        return toks[-NGRAM_MAX:] if pending is None else toks[1 - NGRAM_MAX:] + [pending]

    def learn(self, accepted: int, drafted: int) -> None:
        """Update the acceptance estimate from one verified draft: each position up to
        the first rejection is a trial."""
        self.accept = learn(self.accept, accepted, drafted, ACCEPT_RATE)

    def emitted(self, tokens: list[int]) -> None:
        """Tokens the sequence produced in a plain step: judge the draft it did not send
        (so that drafting resumes when it would have paid)."""
        for t in tokens:
            if not self.shadow:
                return
            if t != self.shadow[self.shadow_hits]:
                self.learn(self.shadow_hits - 1, len(self.shadow) - 1)
                self.shadow, self.shadow_hits = [], 0
                return
            self.shadow_hits += 1
            if self.shadow_hits == len(self.shadow):
                self.learn(self.shadow_hits - 1, self.shadow_hits - 1)
                self.shadow, self.shadow_hits = [], 0


def learn(estimate: float, accepted: int, drafted: int, rate: float) -> float:
    """An acceptance estimate after one verified draft (each position up to the first
    rejection is a trial)."""
    for i in range(min(drafted, accepted + 1)):
        estimate += rate * ((1.0 if i < accepted else 0.0) - estimate)
    return estimate


class StepCost:
    """Seconds per forward pass as ``a + b * tokens read``, fitted by least squares over
    recent steps (older ones weigh less).

    The slope is the fit's only as far as the steps measured can tell it: between the
    prior's (reading 8 more tokens costs a tenth of a step, scaled to the measured time)
    and the fit's, each weighed by its precision (the fit's: the spread of the step
    sizes against the scatter of the times about the line). A batch that decodes at one
    size for a while gives a slope that is noise, 0 as often as not, and a zero slope
    makes the widest draft look free: 32 streams of chat (builtin:scripted with ballast,
    30 rows after ~270 plain steps) took a 9-wide step predicted at a plain step's
    82 ms that took 464 (docs/performance.md)."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self._s = [0.0] * 6  # weights, sum n, sum n^2, sum t, sum n t, sum t^2
        # Before measurements: reading 8 more tokens costs a tenth of a step.
        self._prior = (1.0, 0.0125)
        self.samples = 0

    def add(self, n: int, seconds: float) -> None:
        d = self.decay
        w, sn, snn, st, snt, stt = (x * d for x in self._s)
        self._s = [w + 1, sn + n, snn + n * n, st + seconds, snt + n * seconds,
                   stt + seconds * seconds]
        self.samples += 1

    def __call__(self, n: int) -> float:
        a0, b0 = self._prior
        if self.samples < 4:
            return a0 + b0 * n
        w, sn, snn, st, snt, stt = self._s
        mn, mt = sn / w, st / w
        var_n = max(0.0, snn / w - mn * mn)
        cov = snt / w - mn * mt
        prior_b = b0 * mt / (a0 + b0 * mn)
        if var_n > 1e-9:
            fit_b = cov / var_n
            # scatter about the line, floored at 0.1% of a step (exact test data)
            scatter = max(stt / w - mt * mt - cov * fit_b, (1e-3 * mt) ** 2)
            # the fit's precision (1 / its slope's variance) over the prior's, whose
            # standard deviation is taken as its own size
            weight = w * var_n / scatter * prior_b ** 2
            b = (prior_b + weight * fit_b) / (1 + weight)
        else:
            b = prior_b
        b = max(0.0, b)
        return max(1e-6, mt - b * mn) + b * n


@dataclass
class Stats:
    steps: int = 0  # speculative steps
    drafted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "draft_tokens": self.drafted,
                "accepted_tokens": self.accepted,
                "acceptance": round(self.accepted / self.drafted, 3) if self.drafted
                else None}


class Speculator:
    """Drafts and verifies for one ``GenerationBatch`` (see the module docstring)."""

    def __init__(self, max_draft: int, draft: Optional[DraftModel] = None) -> None:
        self.max_draft = max_draft
        self.draft = draft
        self.rows: dict[int, Row] = {}
        self._joined = False  # whether rows joined the batch in this step
        self.predictions: dict[int, list[int]] = {}  # uid -> predicted output tokens
        # Whether a sequence's client asked for logprobs (the engine's answer; until it
        # gives one, every row gets them). For the others no log-softmax is built for
        # their accepted draft tokens: a lazy one per token took 33 ms of the engine
        # thread a step at 256 rows x 8 tokens, used by no one.
        self.wants_logprobs: Callable[[int], bool] = lambda uid: True
        self.forget_measurements()

    def reset(self) -> None:
        """A new batch (its uids start again from 0): forget every row."""
        self.rows.clear()
        self.predictions.clear()
        if self.draft is not None:
            self.draft.reset()

    def forget_measurements(self) -> None:
        """Start from the priors: step times, acceptance and counts (at start, and after
        the engine's warm-up, whose steps ran cold kernels over no user's text)."""
        self.reset()
        self.cost, self.stats = StepCost(), Stats()
        self.accept = PRIOR_ACCEPT  # over all sequences: a new one's prior (draft model)
        self._idle, self._probe_every = 0, PROBE_EVERY
        if self.draft is not None:
            self.draft.cost = StepCost()

    def predict(self, uid: int, tokens: list[int]) -> None:
        """The client's prediction of ``uid``'s output (OpenAI's ``prediction``)."""
        if tokens:
            self.predictions[uid] = tokens
            while len(self.predictions) > 1024:  # (sequences cancelled before decoding)
                del self.predictions[next(iter(self.predictions))]

    def extract(self, gb: Any, idx: int) -> list:
        """Row ``idx``'s cache taken out of the batch (``GenerationBatch.extract_cache``,
        for the prompt cache), its positions back in order where ``relocate`` moved some:
        the prompt cache cuts caches to a prefix from the end."""
        import mlx.core as mx
        from mlx_lm.generate import GenerationBatch

        caches = GenerationBatch.extract_cache(gb, idx)
        row = self.rows.get(gb.uids[idx])
        if row is None or not row.order.covered:  # (never moved: quantized caches too)
            return caches
        slots = row.order.slots(caches[0].keys.shape[2])
        if slots is not None:
            ix = mx.array(slots)
            for c in caches:
                c.keys, c.values = c.keys[:, :, ix], c.values[:, :, ix]
        return caches

    def next(self, gb: Any) -> list:
        """One decode step of ``gb`` (mlx-lm's ``GenerationBatch``): speculative when it
        pays, else mlx-lm's own."""
        from mlx_lm.generate import GenerationBatch

        if not gb.uids:
            return []
        rows = self._rows(gb)
        drafts = self._plan(gb, rows)
        t0 = time.perf_counter()
        if drafts is None:
            out = GenerationBatch.next(gb)
            if not self._joined:
                self.cost.add(len(rows), time.perf_counter() - t0)
            produced: dict[int, list[int]] = {}
            for r in out:
                produced.setdefault(r.uid, []).append(r.token)
            for uid, toks in produced.items():
                row = self.rows.get(uid)
                if row is not None:
                    row.own.extend(toks)
                    row.emitted(toks)
            return out
        width = 1 + max(len(d) for d in drafts)
        out = self._verify(gb, rows, drafts, width)
        if not self._joined:
            self.cost.add(len(rows) * width, time.perf_counter() - t0)
        return out

    def _rows(self, gb: Any) -> list[Row]:
        """Each batch row's drafting state (made when a sequence first shows up). A step
        that rows joined is not timed for the cost fit: it also pays for their joining
        (their caches merged into the batch's), up to twice a plain step's time while a
        burst's rows come in, which would make every token read look dearer."""
        live = set(gb.uids)
        for uid in [u for u in self.rows if u not in live]:
            del self.rows[uid]
            self.predictions.pop(uid, None)
        out = []
        self._joined = False
        for i, uid in enumerate(gb.uids):
            row = self.rows.get(uid)
            if row is None:
                self._joined = True
                pred = self.predictions.get(uid)
                row = self.rows[uid] = Row(Lookup(gb.tokens[i]),
                                           Lookup(pred) if pred else None)
                if self.draft is not None:  # one draft model drafts for all alike
                    row.accept = self.accept
            out.append(row)
        return out

    def _plan(self, gb: Any, rows: list[Row]) -> Optional[list[list[int]]]:
        """Each row's draft for this step (some empty), or None for a plain step."""
        eligible = [_kind(gb, i) != PLAIN for i in range(len(rows))]
        if self.draft is not None:
            return self._plan_with_model(gb, rows, eligible)
        # Drafts found without the pending token, so one longer: their first token is a
        # guess at it. The width is chosen from them, and only a step that drafts reads
        # the pending tokens: reading them waits for the step in flight, and a plain step
        # that does not wait builds the next pass while this one computes (mlx-lm's
        # overlap, which keeps a GPU busy between steps).
        k = self.max_draft
        guesses = [row.draft(k + 1) if ok else [] for ok, row in zip(eligible, rows)]
        if not any(guesses):
            return None
        ahead = [g[1:] for g in guesses]
        width = self._width(rows, ahead) or self._probe(rows, ahead)
        if width == 0:
            for row, g in zip(rows, guesses):
                if g and not row.shadow:  # judged on the tokens that come instead; a
                    row.shadow, row.shadow_hits = g, 0  # wrong guess judges nothing
            return None
        pending = gb._next_tokens.tolist()
        return [row.draft(width, y) if ok else [] for ok, row, y in zip(eligible, rows, pending)]

    def _plan_with_model(self, gb: Any, rows: list[Row],
                         eligible: list[bool]) -> Optional[list[list[int]]]:
        """Drafts from the draft model (the client's prediction first, where it has
        one), as wide as pays: the width is chosen before drafting, from each row's
        acceptance so far."""
        if not any(eligible):
            return None
        width = self._width(rows, [[0] * self.max_draft if ok else [] for ok in eligible])
        if not width:
            if not self._probe_due():
                return None
            width = min(2, self.max_draft)  # a probe: is it worth drafting again?
        pending = gb._next_tokens.tolist()
        drafted = self.draft.propose(gb.uids, [r.own.tokens for r in rows], pending, width)
        return [(row.from_prediction(width, y) or d) if ok else []
                for ok, row, y, d in zip(eligible, rows, pending, drafted)]

    def _width(self, rows: list[Row], drafts: list[list[int]]) -> int:
        """The draft length that maximizes expected tokens per second (0: don't draft);
        a draft model's passes count in the cost."""
        b = len(rows)
        best, best_rate = 0, b / self.cost(b) * MARGIN
        for k, gain in enumerate(_gains(rows, drafts), start=1):
            drafting = self.draft.seconds(b, k, self.cost) if self.draft else 0.0
            rate = (b + gain) / (self.cost(b * (1 + k)) + drafting)
            if rate > best_rate:
                best, best_rate = k, rate
        if best:
            self._idle, self._probe_every = 0, PROBE_EVERY
        return best

    def _probe(self, rows: list[Row], drafts: list[list[int]]) -> int:
        """A 2-token width now and then when the drafts would be accepted but the cost fit
        judges any wider step too dear (0: not this step). The fit learns what a wide step
        costs only from wide steps; from plain steps alone (the rows of a burst growing
        beside its prefill, whose steps run slower) it can overrate the cost of each token
        read and keep drafting off for a whole burst. Measured (builtin:tiny, 128 streams,
        every draft accepted): one worker start in 4 to 8 took 134 steps, 3 of them
        speculative, where the others took 46-76 (docs/performance.md)."""
        w = min(2, self.max_draft)
        if self._joined:
            return 0  # (its time would not be measured)
        gains = _gains(rows, [d[:w] for d in drafts])
        if not len(gains) or gains[-1] < len(rows) / 2:
            return 0  # acceptance says no, not the cost: shadow drafts keep measuring it
        return w if self._probe_due() else 0

    def _probe_due(self) -> bool:
        """Counts a step that did not draft; True every ``_probe_every``-th (which then
        doubles, up to PROBE_MAX, until a step drafts because it pays)."""
        self._idle += 1
        if self._idle < self._probe_every:
            return False
        self._idle, self._probe_every = 0, min(PROBE_MAX, 2 * self._probe_every)
        return True

    def _verify(self, gb: Any, rows: list[Row], drafts: list[list[int]],
                width: int) -> list:
        """Feed every row's pending token and draft in one pass; keep what the model
        agrees with; cut each row's cache back to what it kept."""
        import mlx.core as mx
        from mlx_lm.generate import GenerationBatch

        b = len(rows)
        pending = gb._next_tokens.tolist()
        pending_lp = gb._next_logprobs
        x = mx.array([[y] + d + [y] * (width - 1 - len(d)) for y, d in zip(pending, drafts)],
                     dtype=mx.uint32)
        logits = gb.model(x, cache=gb.prompt_cache)
        greedy = mx.argmax(logits, axis=-1)
        kinds = [_kind(gb, i) for i in range(b)]
        # Rows that don't draft take one token, as mlx-lm's step would.
        sampled = {}
        for i in (i for i in range(b) if kinds[i] == PLAIN):
            lg = logits[i:i + 1, 0]
            procs = gb.logits_processors[i] if gb.logits_processors else None
            if procs:
                ctx = gb._token_context[i].update_and_fetch(x[i:i + 1, 0])
                for proc in procs:
                    lg = proc(ctx, lg)
            lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
            sampled[i] = (_sampler(gb, i)(lp), lp[0])
        mx.eval(greedy, [t for t, _ in sampled.values()])
        targets = greedy.tolist()

        def logprobs(i: int, j: int):  # (lazy: computed only when a client asked)
            lg = logits[i, j]
            return lg - mx.logsumexp(lg, axis=-1, keepdims=True)

        rejection = [i for i in range(b) if kinds[i] == SAMPLED]
        decided = dict(zip(rejection, accept_sampled(
            [_sampler(gb, i).probs(logits[i, :len(drafts[i]) + 1])
             for i in rejection], [drafts[i] for i in rejection])))

        responses, keep, kept_len = [], [], []
        nxt, nxt_lp = [0] * b, [pending_lp[0]] * b  # (finished rows: placeholders)
        for i, (row, d) in enumerate(zip(rows, drafts)):
            if kinds[i] == PLAIN:
                accepted, follow, follow_lp = 0, int(sampled[i][0].item()), sampled[i][1]
            else:
                if kinds[i] == SAMPLED:
                    accepted, follow = decided[i]
                else:
                    accepted = 0
                    while accepted < len(d) and d[accepted] == targets[i][accepted]:
                        accepted += 1
                    follow = targets[i][accepted]
                follow_lp = logprobs(i, accepted)
                if d:
                    row.learn(accepted, len(d))
                    self.accept = learn(self.accept, accepted, len(d), MODEL_ACCEPT_RATE)
                    self.stats.drafted += len(d)
                    self.stats.accepted += accepted
            emitted = [pending[i]] + d[:accepted]
            lps = [pending_lp[i]] + ([logprobs(i, j) for j in range(accepted)]
                                     if self.wants_logprobs(gb.uids[i]) else [None] * accepted)
            reason, n = None, 0
            for t in emitted:
                n += 1
                gb._num_tokens[i] += 1
                if gb._num_tokens[i] >= gb.max_tokens[i]:
                    reason = "length"
                if gb._matchers[i].advance(t):
                    reason = "stop"
                if reason is not None:
                    break
            emitted, lps = emitted[:n], lps[:n]
            gb.tokens[i].extend(emitted)
            row.own.extend(emitted)
            kept_len.append(n)
            responses.append([GenerationBatch.Response(gb.uids[i], t, lp, None, None, None)
                              for t, lp in zip(emitted, lps)])
            if reason is None:
                keep.append(i)
                nxt[i], nxt_lp[i] = follow, follow_lp
            else:
                responses[-1][-1].finish_reason = reason
        cut_back(gb.prompt_cache, [width - n for n in kept_len], rows)
        for i, rs in enumerate(responses):
            if rs[-1].finish_reason is not None:
                rs[-1].prompt_cache = gb.extract_cache(i)
                rs[-1].all_tokens = gb.tokens[i]
        self.stats.steps += 1
        gb._current_tokens = mx.array(pending, dtype=mx.uint32)
        gb._next_tokens = mx.array(nxt, dtype=mx.uint32)
        gb._next_logprobs = nxt_lp
        if len(keep) < b:
            gb.filter(keep)
        if keep:
            mx.async_eval(gb._next_tokens, gb._next_logprobs)
        return [r for rs in responses for r in rs]


def _gains(rows: list[Row], drafts: list[list[int]]) -> Any:
    """The tokens that drafts of each length k = 1, 2 ... (cut to each row's own) are
    expected to add over all rows: a row with acceptance p and a draft of m tokens adds
    p + p^2 + ... + p^min(k, m). For every k in one go: per row and k in Python it took
    3.6 ms a step at 256 rows (1.5 ms at 128), the engine thread's time and the GIL's;
    this takes a fraction of a millisecond."""
    import numpy as np

    k = max((len(d) for d in drafts), default=0)
    p = np.fromiter((r.accept for r in rows), float, len(rows))[:, None]
    n = np.fromiter((len(d) for d in drafts), int, len(drafts))[:, None]
    j = np.arange(1, k + 1)
    return np.where(j <= n, p ** j, 0.0).cumsum(axis=1).sum(axis=0)


def cut_back(caches: list, discard: list[int], rows: Optional[list[Row]] = None) -> None:
    """Drop each row's last ``discard[i]`` positions of batched KV ``caches``: the write
    index goes back by the least of them, the rest become left padding (by ``relocate``
    where ``rows`` can track the order it leaves, else by shifting rows)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    least = min(discard)
    extra = [n - least for n in discard]
    if least:
        for c in caches:
            c.trim(least)
    if any(extra):
        pad = mx.array(extra)

        def plain(c: Any) -> bool:  # a filled buffer of mlx-lm's own keys and values
            return type(c) is BatchKVCache and c.keys is not None and c._idx > 0

        if not (rows is not None and all(map(plain, caches))
                and relocate(caches, extra, pad, rows)):
            for c in caches:
                if plain(c):
                    shift_right(c, pad)
                else:  # (quantized and draft caches of other kinds: mlx-lm's own roll)
                    c.prepare(right_padding=extra)
                    c.finalize()
    mx.eval([c.state for c in caches])


def relocate(caches: list, extra: list[int], pad: Any, rows: list[Row]) -> bool:
    """Cut rows back by moving only the positions they rejected: each row's ``extra[i]``
    rejected slots at the end take its oldest positions, which then count as left
    padding. Attention reads the same keys and values (their positions are already in
    them; a softmax over keys does not depend on their order), so only the slots a row
    holds its positions in change (``Row.order``, put back in order when its cache is
    taken out). O(rows x extra) where shifting rows is O(rows x positions): the shift
    cost a verify step as much as its forward pass (docs/performance.md). False (nothing
    done) when a row holds fewer positions than it rejected."""
    import mlx.core as mx

    n = caches[0]._idx
    lp = caches[0].left_padding.tolist()
    held = [n - p - e for p, e in zip(lp, extra)]  # each row's positions, rejected aside
    if any(h < e for h, e in zip(held, extra)):
        return False
    w = max(extra)
    j = mx.arange(n - w, n)[None, :]  # the last w slots
    e = pad[:, None]
    src = mx.where(j >= n - e, mx.array(lp)[:, None] + j - (n - e), j)[:, None, :, None]
    moved = [[mx.take_along_axis(x[..., :n, :], src, axis=2) for x in (c.keys, c.values)]
             for c in caches]
    mx.eval(moved)  # first, so that the writes below update the buffers in place
    for c, (k, v) in zip(caches, moved):
        c.keys[..., n - w:n, :] = k
        c.values[..., n - w:n, :] = v
        c.offset = c.offset - pad
        c.left_padding = c.left_padding + pad
    for row, h, k in zip(rows, held, extra):
        if k:
            row.order.rotate(h, k)
    return True


def shift_right(c: Any, pad: Any) -> None:
    """What ``BatchKVCache.prepare(right_padding=pad)`` + ``finalize()`` do to the keys and
    values a row holds: each row's positions up to the write index move ``pad[row]`` to
    the right, and that many more of its positions count as left padding. mlx-lm rolls
    the whole buffer with an index per element (``take_along_axis``); this moves each
    (row, head, position) vector whole and leaves the buffer past the write index alone.
    Where ``relocate`` cannot (a draft model's caches, a row holding fewer positions than
    it rejected). Measured on this CPU, 32 rows of 400 positions with tiny-50m's 15 layers
    x 4 heads x 64: 170 against 309 ms (each the best of 40); with builtin:tiny's 16-wide
    heads no faster (36 against 32 ms at 256 rows). docs/performance.md."""
    import mlx.core as mx

    n = c._idx
    b, h, size = c.keys.shape[:3]
    src = (mx.arange(n)[None, None, :] - pad[:, None, None]) % n
    rows = (mx.arange(b)[:, None, None] * h + mx.arange(h)[None, :, None]) * size
    flat = (rows + src).reshape(-1)

    def roll(x: Any) -> Any:
        head = mx.take(x.reshape(b * h * size, x.shape[3]), flat, axis=0)
        head = head.reshape(b, h, n, x.shape[3])
        return head if n == size else mx.concatenate([head, x[..., n:, :]], axis=2)

    c.keys, c.values = roll(c.keys), roll(c.values)
    c.offset = c.offset - pad
    c.left_padding = c.left_padding + pad


class DraftModel:
    """A smaller model with the target's tokenizer that drafts for every row at once,
    greedily (a deterministic proposal: rejection sampling against it keeps a sampled
    row's distribution exact).

    It keeps its own batched KV cache, in step with the batch's rows: rows that left
    are filtered out, rows that arrived are prefilled (left-padded, in one batch), and
    each row's positions past what the target accepted are cut back, like the target's
    (``cut_back``). Rows the last steps did not draft for fall behind; each step first
    feeds every row the tokens it misses (the same number for all: a row missing fewer
    is cut back further and fed again)."""

    def __init__(self, model: Any, vocab: int, prefill_step: int = 512) -> None:
        self.model = model
        self.vocab = vocab
        self.prefill_step = prefill_step
        self.cost = StepCost()  # one draft pass: seconds against rows
        self.reset()

    def reset(self) -> None:
        self.uids: list[int] = []
        self.cache: Optional[list] = None
        # per row: how many of its tokens the cache holds as confirmed, then the draft
        # tokens fed after them (confirmed or not by the target since)
        self.confirmed: list[int] = []
        self.fed: list[list[int]] = []

    def seconds(self, rows: int, k: int, target: StepCost) -> float:
        """Expected seconds to draft ``k`` tokens for ``rows`` rows."""
        per_pass = self.cost(rows) if self.cost.samples >= 4 else 0.1 * target(rows)
        return k * per_pass

    def propose(self, uids: list[int], tokens: list[list[int]], pending: list[int],
                k: int) -> list[list[int]]:
        """``k`` draft tokens for each row: ``tokens[i] + [pending[i]]`` is row ``i``'s
        sequence so far."""
        import mlx.core as mx

        t0 = time.perf_counter()
        self._sync(uids, tokens)
        # (only the few tokens past what the cache confirmed are compared: a row's whole
        # sequence is never copied on this per-step path)
        valid = [c + _common(f, (t[c:c + len(f)] + [y])[:len(f)])
                 for c, f, t, y in zip(self.confirmed, self.fed, tokens, pending)]
        held = [c + len(f) for c, f in zip(self.confirmed, self.fed)]
        gaps = [len(t) + 1 - v for t, v in zip(tokens, valid)]
        m = max(gaps)
        if any(v - (m - g) < 0 for v, g in zip(valid, gaps)):  # (a very short row)
            self.reset()
            return self.propose(uids, tokens, pending, k)
        cut_back(self.cache, [h - v + m - g for h, v, g in zip(held, valid, gaps)])
        x = mx.array([t[len(t) - m + 1:] + [y] for t, y in zip(tokens, pending)],
                     dtype=mx.uint32)
        out = []
        for _ in range(k):
            logits = self.model(x, cache=self.cache)[:, -1, :self.vocab]
            x = mx.argmax(logits, axis=-1)[:, None].astype(mx.uint32)
            out.append(x)
        drafts = mx.concatenate(out, axis=1).tolist()
        self.confirmed = [len(t) + 1 for t in tokens]
        self.fed = [d[:-1] for d in drafts]  # the last draft token is not in the cache
        self.cost.add(len(tokens), (time.perf_counter() - t0) / k)
        return drafts

    def _sync(self, uids: list[int], tokens: list[list[int]]) -> None:
        """Make the cache's rows ``uids``: drop the rows that left; prefill the new ones
        (all but their last token), which mlx-lm appends at the end."""
        import mlx.core as mx
        from mlx_lm.models.cache import BatchKVCache

        if uids == self.uids:
            return
        at = {u: i for i, u in enumerate(self.uids)}
        staying = [u for u in uids if u in at]
        if staying != uids[:len(staying)] or [at[u] for u in staying] != sorted(
                at[u] for u in staying):
            self.reset()  # reordered: start again
            staying, at = [], {}
        keep = [at[u] for u in staying]
        if self.cache is not None and len(keep) < len(self.uids):
            if keep:
                for c in self.cache:
                    c.filter(keep)
                self.confirmed = [self.confirmed[i] for i in keep]
                self.fed = [self.fed[i] for i in keep]
            else:
                self.reset()
        prompts = tokens[len(staying):]  # (each row's pending token is fed by propose)
        if prompts:
            longest = max(len(p) for p in prompts)
            pads = [longest - len(p) for p in prompts]
            caches = [BatchKVCache(pads) for _ in self.model.layers]
            x = mx.array([[0] * n + p for n, p in zip(pads, prompts)], dtype=mx.uint32)
            for i in range(0, longest, self.prefill_step):
                self.model(x[:, i:i + self.prefill_step], cache=caches)
                mx.eval([c.state for c in caches])
            if self.cache is None:
                self.cache = caches
            else:
                for c, more in zip(self.cache, caches):
                    c.extend(more)
            self.confirmed += [len(p) for p in prompts]
            self.fed += [[] for _ in prompts]
        self.uids = list(uids)


def _common(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
