"""The MLX engine: one thread that owns the model and runs continuous batching.

MLX arrays and streams belong to the thread that made them, so every MLX call
(load, sampler construction, ``BatchGenerator`` steps, logprob extraction,
the prompt cache) happens on the engine thread. Async handlers talk to it
through a thread-safe inbox; results come back to the event loop once per
step, in one ``call_soon_threadsafe`` for the whole batch rather than one per
token. Tokens are turned into text here too (``decode.py``), so a stop string
ends its sequence in the step that produced it. The thread publishes a status
report (``Engine.report``); nothing else reads MLX or the prompt cache.

About 800 lines on purpose: everything here runs on the one engine thread and shares
its state (the batch, the prompt cache, the live sequences); splitting it would pass
that state between modules without making any part simpler. What can live apart
does: decisions in ``policy.py`` (pure), per-architecture facts in ``model_facts.py``,
the prompt cache in ``prompt_cache.py``, detokenizing in ``decode.py``, sampling in
``sampling.py``, grammars in ``grammar.py``, vision and sharded models in their own
modules.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import functools
import gc
import logging
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ..formats import pick_parsers
from ..worker_settings import WorkerConfig
from .decode import SequenceDecoder, marker_ids, special_token_ids
from .generation import (
    EngineError,
    EngineState,
    EngineStats,
    Generation,
    Rejected,
    TokenEvent,
)
from .last_position import last_position_only, supported
from .model_facts import (
    KVCost,
    cache_kinds,
    context_length,
    grammar_stats,
    kv_bytes_per_token,
    kv_cost,
    mlx_memory,
    prefill_alone,
    recurrent,
)
from .policy import AdmissionPolicy
from .prompt_cache import PromptCache, compact
from .prompts import template_style
from .sampling import Samplers, SamplingParams, logits_processors
from .speculative import DraftModel, Speculator, unsupported
from .tokenizer_json import quick_tokenizer_json
from .vocab import additive_mask, mask_unknown_ids, unknown_ids

log = logging.getLogger("mlxfleet.engine")

REPORT_INTERVAL = 0.1  # seconds between status reports while busy


@dataclass
class _Submit:
    gen: Generation


@dataclass
class _Cancel:
    gen: Generation


@dataclass
class _Seq:
    gen: Generation
    index: int
    reserved: int  # KV bytes held for this sequence while it runs
    decoder: SequenceDecoder
    processors: list = field(default_factory=list)  # its logits processors
    key: Optional[list[int]] = None  # prompt-cache key of a prompt with images
    prompt_length: int = 0  # its prompt's tokens (the longest of its request's prompts)
    length: int = 0  # tokens it holds now (prompt and output)
    reserved_length: int = 0  # tokens its reservation covers

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """mlx-lm's reason, except that a value the token budget forced closed (see
        ``GrammarProcessor``) ended for ``length``, even if end-of-sequence came last."""
        if reason == "stop" and any(getattr(p, "forced_close", False)
                                    for p in self.processors):
            return "length"
        return reason


    def grammar_error(self) -> Optional[str]:
        """Why the grammar engine gave up on this sequence (a resource limit hit past
        the request's checks), if it did."""
        return next((p.error for p in self.processors if getattr(p, "error", None)), None)


#: Batch steps failing this many times in a row take the engine down (restart).
STEP_FAILURES_FATAL = 3
IDLE_GC_S = 2.0  # seconds idle before a full garbage collection (see _idle_wait)
#: Output tokens a sequence reserves KV for at a time (``Engine._need``, ``_grow``).
RESERVE_TOKENS = 1024


class Engine:
    """Loads one model on a dedicated thread and serves generations from it."""

    def __init__(self, config: WorkerConfig, policy: Optional[AdmissionPolicy] = None):
        self.source = config.source
        self.config = config
        self._policy_override = policy
        self.state = EngineState.PENDING
        self.error: Optional[str] = None
        self.tokenizer: Any = None
        self.model_path: Optional[str] = None
        self.context_length: Optional[int] = None
        self.vocab_size: Optional[int] = None
        self.unknown_ids: frozenset[int] = frozenset()  # model rows the tokenizer lacks
        self._unknown_mask: Any = None
        self._one_pass = False  # a lone prompt in one pass (last_position.py)
        self.load_seconds: Optional[float] = None
        self.stats = EngineStats()
        # (when, seconds) a request waited for its first token: the median of the last
        # minute is what a fleet scales a replicated model by
        self._waits: collections.deque[tuple[float, float]] = collections.deque(maxlen=1024)
        self.report: dict[str, Any] = {}  # published by the engine thread (see _publish)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._stop = False
        self._published = 0.0
        self.announced = 0  # requests being parsed and tokenized on the event loop
        # Engine-thread liveness, for /health: when the loop last went round, and whether
        # it has work (an idle engine blocks on its inbox, which is not a stall).
        self.heartbeat = time.monotonic()
        self.busy = False
        self.memory_limit: Optional[int] = None  # MLX's limit, set after the load
        self.vision: Any = None  # a vision.VisionModel when the model reads images
        self.parsers: Any = None  # formats.Parsers, picked at load
        self.template_style: Any = None  # prompts.TemplateStyle, read at load
        self.paths: dict[str, Any] = {}  # the exact paths this architecture takes
        self._step_failures = 0  # in a row; past STEP_FAILURES_FATAL the engine gives up
        self._joined = False  # the last step moved prompts from prefill to generation
        self._forget_timings()

    def _forget_timings(self) -> None:
        """No step or arrival measured yet (at start, and after the warm-up's)."""
        # Seconds of a step without prefill work and the extra of one with it (moving
        # averages): what ``first_tokens_first`` weighs.
        self._decode_s, self._prefill_s = 0.0, float("inf")  # (inf: not measured yet)
        self._last_arrival = self._previous_arrival = float("-inf")  # submit times

    # ---- event-loop side -------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.state = EngineState.LOADING
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._thread.start()

    def problem(self) -> Optional[str]:
        """Why a ready engine cannot serve (its thread died or is stuck), else None."""
        if self.state != EngineState.READY:
            return None
        if self._thread is not None and not self._thread.is_alive():
            return "the engine thread is not running"
        stalled = time.monotonic() - self.heartbeat
        if self.busy and stalled > self.config.stall_timeout:
            return f"the engine has not made progress for {stalled:.0f}s"
        return None

    async def wait_ready(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)

    def announce(self, delta: int) -> None:
        """The HTTP side is preparing (+1) or gave up on (-1) a request (see _coalesce)."""
        self.announced += delta

    def submit(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
               vision: Any = None, cache_scope: str = "") -> Generation:
        """Queue a generation; ``vision`` (an ``images.VisionPrompt``) when the one prompt
        holds images; ``cache_scope``: whose prompt cache it reads and fills (see
        ``prompt_cache``)."""
        gen = Generation(prompts, params, n)
        gen.vision, gen.cache_scope = vision, cache_scope
        self._inbox.put(_Submit(gen))
        return gen

    def cancel(self, gen: Generation) -> None:
        """Drop all of ``gen``'s sequences from the batch (the client is gone)."""
        if not gen.cancelled:
            gen.cancelled = True
            self._inbox.put(_Cancel(gen))

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        self.state = EngineState.STOPPED

    # ---- engine thread ---------------------------------------------------

    def _run(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - any load failure is reported, not raised
            log.exception("loading %s failed", self.source)
            self.error = f"{type(e).__name__}: {e}"
            self.state = EngineState.FAILED
            self._ready.set()
            self._fail_pending()
            return
        if not self.config.sharded and self.config.warmup:
            self._warm_up()
        self._publish(force=True)  # (before READY: a status read once /health says ready
        self.state = EngineState.READY  # had the empty report, without its paths; CI)
        self._ready.set()
        try:
            if self.config.sharded and self.config.dist_rank > 0:
                from .distributed import follow

                follow(self, self._channel)  # ranks other than 0 only mirror rank 0
                if not self._stop:
                    raise RuntimeError("rank 0 stopped")
            else:
                self._serve()
            if self.config.sharded and self.config.dist_rank == 0:
                self._bg.close()  # the other ranks stop with this one
        except Exception as e:  # noqa: BLE001
            log.exception("engine loop crashed")
            if self.config.sharded:  # a broken group is restarted whole, by the supervisors
                from .distributed import GROUP_LOST

                log.error("rank %d: the group is broken; exiting so that it restarts",
                          self.config.dist_rank)
                logging.shutdown()
                os._exit(GROUP_LOST)
            self.error = f"engine crashed: {type(e).__name__}: {e}"
            self.state = EngineState.FAILED
            self._fail_active(self.error)
            self._fail_pending()
        finally:
            if hasattr(self, "prompt_cache"):  # (not when the load failed)
                try:  # the disk tier keeps what memory held, for the next worker
                    self.prompt_cache.flush()
                except Exception:  # noqa: BLE001
                    log.exception("writing the prompt cache to disk failed")
            # Free MLX objects on the thread that made them.
            self._bg = None
            self._model = None

    def _load(self) -> None:
        import mlx.core as mx

        from ..sources import resolve_source

        t0 = time.monotonic()
        path = resolve_source(self.source, revision=self.config.revision)
        self.model_path = str(path)
        trust = {"trust_remote_code": self.config.trust_remote_code}
        with quick_tokenizer_json():
            model, tokenizer, config = self._load_checkpoint(path, trust)
            vocab = tokenizer.get_vocab()  # (the one listing the load made; see tokenizer_json)
        self.tokenizer = tokenizer
        self.context_length = self.config.context_length or context_length(config, tokenizer)
        self.vocab_size = int(config.get("vocab_size")
                              or (config.get("text_config") or {}).get("vocab_size")
                              or len(tokenizer))
        # rows the tokenizer has no id for: never sampled, never fed back (vocab.py)
        self.unknown_ids = unknown_ids(vocab, self.vocab_size)
        self._markers = marker_ids(vocab)  # (stay in the text even when they are special)
        self._unknown_mask = additive_mask(self.vocab_size, self.unknown_ids)
        if self._unknown_mask is not None:
            model = mask_unknown_ids(model, self._unknown_mask)
        self._model = model
        # a lone prompt read in one pass, its head at the last position (last_position.py)
        self._one_pass = not self.config.sharded and supported(model)
        self._stream = mx.default_stream(mx.default_device())
        self._quantize_kv()
        self._describe_paths(config)
        # MLX keeps freed buffers for reuse; unbounded, that cache alone can outgrow the
        # model. Bound it by the KV budget so the worker's memory stays predictable.
        mx.set_cache_limit(max(64 << 20, self.config.cache_bytes // 4))
        # This worker's share of memory: its weights, its KV budget and room for
        # activations. Past it MLX frees its cache and waits for work in flight before
        # allocating more; only with no memory left does an allocation fail, and that
        # fails the batch (see _serve), not the process.
        self.memory_limit = (mx.get_active_memory() + self.config.cache_bytes
                             + max(512 << 20, self.config.cache_bytes // 2))
        mx.set_memory_limit(self.memory_limit)
        if self.config.wired_limit_bytes and mx.metal.is_available():
            mx.set_wired_limit(self.config.wired_limit_bytes)
        self._init_batching()
        self.load_seconds = time.monotonic() - t0
        log.info("loaded %s from %s in %.2fs (context %s)", self.source, path,
                 self.load_seconds, self.context_length)

    def _load_checkpoint(self, path: Any, trust: dict) -> tuple[Any, Any, dict]:
        """The model, its tokenizer and its config: sharded, vision or plain mlx-lm."""
        from mlx_lm import load

        from ..sources import is_vision_checkpoint

        if self.config.sharded:
            from .distributed import Channel, init_group, load_sharded

            if self.config.task == "vision" or is_vision_checkpoint(path):
                raise ValueError("vision models cannot be sharded (spec.distributed)")
            group = init_group(self.config)
            self._channel = Channel(group)
            model, tokenizer, config = load_sharded(str(path), self.config, group, trust)
        elif self.config.task == "vision" or is_vision_checkpoint(path):
            from mlx_lm.utils import load_tokenizer

            from .vision import VisionModel

            self.vision = VisionModel(path, self.config.trust_remote_code)
            model, config = self.vision.text, self.vision.config
            tokenizer = load_tokenizer(path, trust, eos_token_ids=config.get("eos_token_id"))
        else:
            from ..scripted import register

            register()  # builtin:scripted's model type, for mlx-lm to find
            model, tokenizer, config = load(str(path), return_config=True,
                                            tokenizer_config=trust)
            if hasattr(model, "attach_tokenizer"):  # the scripted model reads the text
                model.attach_tokenizer(tokenizer)
        return model, tokenizer, config

    def _quantize_kv(self) -> None:
        """``spec.cache.kvBits``: the model's caches become quantized ones where it can
        (``quantized_cache.py``); ``paths.kv_cache`` says which, or why not."""
        from .quantized_cache import quantization_group, quantize_kv

        bits, self._kv_bits = self.config.kv_bits, None
        if not bits:
            self._kv_note = "full precision"
            return
        group, why = quantization_group(self._model, bits, self.config.sharded,
                                        self.vision is not None)
        if group is None:
            self._kv_note = f"full precision: {why}"
            return
        quantize_kv(self._model, bits, group)
        self._kv_bits = bits
        self._kv_note = f"quantized to {bits} bits (groups of {group})"

    def _describe_paths(self, config: dict) -> None:
        """Which exact path this architecture takes where the fast one would be wrong
        (published in the status as ``paths``)."""
        model_type = config.get("model_type") or (config.get("text_config") or {}).get(
            "model_type")
        self._prefill_alone = prefill_alone(self._model, model_type)
        kinds = cache_kinds(self._model)
        # A cache that cannot be cut back to an arbitrary prefix (recurrent state; a
        # sliding window once past its size) is kept as it stood at the end of each
        # prompt too: the next turn of the conversation extends that prompt.
        self._snapshots = not self.config.sharded and (
            recurrent(self._model) or "RotatingKVCache" in kinds)
        cfg = self.config
        template, self.template_style = template_style(
            getattr(self.tokenizer, "chat_template", None))
        if template is not None and template != self.tokenizer.chat_template:
            self.tokenizer.chat_template = template
        self.parsers = pick_parsers(model_type, getattr(self.tokenizer, "chat_template", None),
                                    cfg.tool_call_parser, cfg.reasoning_parser)
        self.paths = {
            "model_type": model_type, "caches": kinds, "parsers": self.parsers.as_dict(),
            "prefill": "one prompt at a time: padding would run through the recurrent "
                       "state" if self._prefill_alone else "batched",
            "kv_cache": self._kv_note,
            "prefix_reuse": "prompt ends: a cache with recurrent state or a sliding "
                            "window cannot be cut back to any prefix" if self._snapshots
                            else "any prefix",
            "lone_prompt": "one pass, the head at its last position" if self._one_pass
                           else "two passes (all but the last token, then the last)",
        }
        self._speculator = None
        if cfg.speculative == "off":
            self.paths["speculation"] = "off (spec.speculative.mode)"
        elif why := unsupported(self._model, cfg.sharded, self.vision is not None):
            self.paths["speculation"] = f"off: {why}"
        elif cfg.draft_model:
            self._speculator = Speculator(cfg.draft_tokens, self._load_draft(cfg.draft_model))
            self.paths["speculation"] = (f"draft model {cfg.draft_model}, up to "
                                         f"{cfg.draft_tokens} draft tokens per step when "
                                         "it pays")
        else:
            self._speculator = Speculator(cfg.draft_tokens)
            self.paths["speculation"] = (f"prompt lookup, up to {cfg.draft_tokens} draft "
                                         "tokens per step when it pays")
        if self._speculator is not None:
            self._speculator.wants_logprobs = self._wants_logprobs

    def _load_draft(self, source: str) -> DraftModel:
        """``spec.speculative.draftModel``: loaded like the model; it must read and write
        the same tokens, and its cache must be cut back like the model's."""
        from mlx_lm import load

        from ..sources import resolve_source

        with quick_tokenizer_json():
            model, tokenizer = load(str(resolve_source(source)))
        if hasattr(model, "attach_tokenizer"):  # (builtin:scripted)
            model.attach_tokenizer(tokenizer)
        if tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"the draft model {source} has another tokenizer than "
                             f"{self.source}: its drafts would be other tokens")
        if why := unsupported(model, False, False):
            raise ValueError(f"the draft model {source} cannot draft: {why}")
        if self._unknown_mask is not None:  # its drafts are fed to the model: real ids only
            model = mask_unknown_ids(model, self._unknown_mask)
        return DraftModel(model, self.vocab_size, self.config.prefill_step_size)

    def _prefill_batch(self) -> int:
        cfg = self.config
        return 1 if self._prefill_alone else min(cfg.prefill_batch_size, cfg.max_concurrency)

    def _new_batch(self) -> None:
        from mlx_lm.generate import BatchGenerator

        cfg = self.config
        self._bg = BatchGenerator(
            self._model,
            stop_tokens=[[t] for t in self.tokenizer.eos_token_ids],
            completion_batch_size=cfg.max_concurrency,
            prefill_batch_size=self._prefill_batch(),
            prefill_step_size=cfg.prefill_step_size,
            stream=self._stream,
        )
        if self._speculator is not None:  # it takes the place of mlx-lm's decode step
            self._speculator.reset()  # (the new batch numbers its sequences from 0 again)
            gb = self._bg._generation_batch
            gb.next = functools.partial(self._speculator.next, gb)
            gb.extract_cache = functools.partial(self._speculator.extract, gb)

    def _init_batching(self) -> None:
        from mlx_lm.generate import StopSequences

        cfg = self.config
        self._new_batch()
        # (a sharded model cannot run a token on one rank alone: estimated from its shape)
        kv = KVCost(kv_bytes_per_token(self._model)) if cfg.sharded else kv_cost(self._model)
        if self._speculator is not None and self._speculator.draft is not None:
            kv += kv_cost(self._speculator.draft.model)  # its cache grows with each row's
        self.paths["kv"] = kv.as_dict()
        self.policy = self._policy_override or AdmissionPolicy(
            budget=cfg.cache_bytes, kv_per_token=kv.per_token, kv_windows=kv.windows,
            kv_fixed=kv.fixed, prefill_step=cfg.prefill_step_size,
            prefill_batch=self._prefill_batch())
        self._seqs: dict[int, _Seq] = {}
        self._samplers = Samplers()
        self._pending: collections.deque[Generation] = collections.deque()
        self._no_stop = StopSequences(None)
        self._special = special_token_ids(self.tokenizer) - self._markers
        self._reserved = 0
        self.prompt_cache = self._new_prompt_cache()
        if cfg.sharded and cfg.dist_rank == 0:
            from .distributed import MirroredBatch

            self._bg = MirroredBatch(self._bg, self._channel)

    def _warm_up(self) -> None:
        """Run once, before READY, what a user's first requests would run first: the chat
        template rendered (Jinja compiles it on first use), a lone prompt (its one-pass
        first token), then a batch of greedy and sampled rows of several lengths, one of
        them a prompt-cache hit, decoding (and drafting, where the model drafts) a few
        steps. Kernels that MLX builds on first use (compiled functions traced, Metal and
        CUDA kernels built, the CPU backend's compiled C++ loaded) are built here, not in
        a first burst (issue #46: on CUDA a first 8-stream burst ran at a sixth of a
        later one). What the warm-up measured and
        stored is then forgotten: its steps' times were cold, its prompts are no user's."""
        from dataclasses import replace

        t0 = time.monotonic()
        text = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 8
        ids = [t for t in self.tokenizer.encode(text) if t not in self.unknown_ids][:64]
        if len(ids) < 16:
            return
        q = len(ids) // 4
        greedy = SamplingParams(max_tokens=4, ignore_eos=True)
        rounds = [
            [Generation([ids[:q]], greedy, 1)],
            [Generation([ids[:2 * q], ids[:3 * q], ids[:q] + ids[3 * q:]],
                        replace(greedy, max_tokens=8), 1),
             Generation([ids[q:3 * q]], replace(greedy, max_tokens=8, temperature=0.8,
                                                top_p=0.9), 1)],
        ]
        try:  # (builtin:tiny's: 25 ms, which the first chat request took 42 ms instead of 11)
            self.tokenizer.apply_chat_template([{"role": "user", "content": text[:24]}],
                                               add_generation_prompt=True, tokenize=True)
        except Exception as e:  # noqa: BLE001 - no template, or one that wants more
            log.debug("warm-up: chat template not rendered: %s", e)
        real_cache = self.prompt_cache
        self.prompt_cache = self._new_prompt_cache(with_disk=False)
        try:
            for gens in rounds:
                for gen in gens:
                    self._handle(_Submit(gen))
                for _ in range(100):  # (a few steps; bounded, whatever the model does)
                    self._admit()
                    if not self._seqs:
                        break  # all done, or a KV budget too small to start them
                    self._step()
        except Exception as e:  # noqa: BLE001 - the first request will say what is wrong
            log.warning("warm-up failed: %s: %s", type(e).__name__, e)
        if self._pending or self._seqs:  # (failed or cut short: start from an empty batch)
            self._seqs, self._reserved = {}, 0
            self._pending.clear()
            self._new_batch()
        self.prompt_cache = real_cache
        self.stats = EngineStats()
        self._waits.clear()
        self._forget_timings()
        if self._speculator is not None:
            self._speculator.forget_measurements()
        log.info("warmed up in %.2fs", time.monotonic() - t0)

    def _new_prompt_cache(self, with_disk: bool = True):
        """The block cache when asked for and the model's layers can be cut into blocks
        (plain ``KVCache``), else the whole-prompt LRU; none for a sharded model.
        ``with_disk=False``: without the disk tier (the warm-up's)."""
        cfg = self.config
        if cfg.sharded:
            from .distributed import NoPromptCache

            return NoPromptCache()
        if cfg.paged_cache:
            from mlx_lm.models.cache import KVCache, make_prompt_cache

            from .block_cache import BlockCache

            kinds = {type(c) for c in make_prompt_cache(self._model)}
            if kinds == {KVCache}:
                return BlockCache(cfg.cache_bytes)
            log.warning("this model's KV caches (%s) cannot be cut into blocks; keeping "
                        "whole prompts", ", ".join(sorted(k.__name__ for k in kinds)))
        disk = None
        if with_disk and cfg.disk_cache_bytes and cfg.disk_cache_dir:
            from pathlib import Path

            from .disk_cache import DiskTier, identity

            disk = DiskTier(Path(cfg.disk_cache_dir),
                            identity(cfg.source, cfg.revision, self._kv_bits),
                            cfg.disk_cache_bytes)
            log.info("prompt cache disk tier: %d entries in %s", len(disk.files), disk.dir)
        return PromptCache(cfg.cache_bytes, disk)

    def _serve(self) -> None:
        while not self._stop:
            self.heartbeat = time.monotonic()
            if not self._seqs and not self._pending:
                self._publish(force=True)
                self.busy = False
                item = self._idle_wait()  # idle: sleep until there is work
                self.busy, self.heartbeat = True, time.monotonic()
                if not self._handle(item):
                    break
                if not self._coalesce():
                    break
            while True:  # drain everything that arrived during the last step
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if not self._handle(item):
                    return
            self._admit()
            if self._seqs:
                try:
                    self._step()
                    self._step_failures = 0
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: see _step_failed
                    self._step_failed(e)
            self._publish()

    def _idle_wait(self):
        """The next inbox item. ``IDLE_GC_S`` into an idle spell the garbage collector
        runs in full: the worker makes full collections rare while it works
        (``server.GC_GEN0``), and cycles a burst left, MLX arrays among them, are freed
        here rather than whenever the next burst allocates. A sharded model's rank 0
        pings the other ranks every few seconds meanwhile, so a lost peer is found
        before a request needs it."""
        collect_at: Optional[float] = time.monotonic() + IDLE_GC_S
        while True:
            timeout = 5.0 if self.config.sharded else None
            if collect_at is not None:
                timeout = max(0.0, min(timeout or IDLE_GC_S, collect_at - time.monotonic()))
            try:
                return self._inbox.get(timeout=timeout)
            except queue.Empty:
                if collect_at is not None and time.monotonic() >= collect_at:
                    gc.collect()
                    collect_at = None
                elif self.config.sharded:
                    self._bg.ping()

    def _step_failed(self, e: Exception) -> None:
        """A batch step raised (an allocation beyond what the machine has, most likely):
        fail the running requests with a clear error, start an empty batch and keep
        serving. Several failures in a row mean the engine is broken: give up (the
        worker reports failed and the supervisor restarts it)."""
        import mlx.core as mx

        self._step_failures += 1
        if self.config.sharded:
            raise e  # the other ranks cannot follow a new batch mid-way: restart the group
        log.error("generation step failed (%d in a row): %s: %s", self._step_failures,
                  type(e).__name__, e, exc_info=e)
        if self._step_failures >= STEP_FAILURES_FATAL:
            raise e
        self._fail_active(f"{type(e).__name__}: {e}")
        self._reserved = 0
        self._new_batch()
        mx.clear_cache()
        self._count()

    def _coalesce(self) -> bool:
        """After an idle spell, wait briefly for more requests so that a burst is
        prefilled in full batches (``AdmissionPolicy`` says whether and how long)."""
        now = time.monotonic()
        if not self.policy.gathers(self.announced, now - self._previous_arrival):
            return True
        deadline = now + self.policy.batch_wait
        while True:
            timeout = self.policy.gather_timeout(len(self._pending), time.monotonic(),
                                                 deadline)
            if timeout is None:
                return True
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                if self.policy.gather_on_quiet(self.announced):
                    continue
                return True
            if not self._handle(item):
                return False

    def _need(self, gen: Generation) -> int:
        """KV bytes one of ``gen``'s sequences reserves to start: its prompt and up to
        ``RESERVE_TOKENS`` of output (more as it grows: ``_grow``). Reserving a whole
        ``max_tokens`` up front let one agent asking for 32k tokens, or a request with no
        limit (the context left), hold the budget of dozens of real answers."""
        return self.policy.need(max(len(p) for p in gen.prompts),
                                min(gen.params.max_tokens, RESERVE_TOKENS))

    def _grow(self, seq: _Seq) -> None:
        """A sequence past its reservation reserves the next ``RESERVE_TOKENS`` (never
        more than its ``max_tokens``); retained prompt caches give way first. Running
        sequences are never stopped for it: new ones wait until there is room."""
        prompt = seq.prompt_length
        out = min(seq.length - prompt + RESERVE_TOKENS, seq.gen.params.max_tokens)
        more = self.policy.need(prompt, out) - seq.reserved
        seq.reserved_length = prompt + out
        if more > 0:
            seq.reserved += more
            self._reserved += more
            self.prompt_cache.trim(self.policy.budget - self._reserved)

    def _admit(self) -> None:
        """Start waiting generations while their KV fits the budget; retained prompt
        caches give way first."""
        while self._pending and self._pending[0].cancelled:
            self._pending.popleft()
        if not self._pending:
            return
        if self.policy.hold(len(self._seqs), len(self._pending),
                            time.monotonic() - self._pending[0].submitted_at):
            return
        needs = [self._need(g) * g.num_sequences for g in self._pending]
        for _ in range(self.policy.admit(len(self._seqs), self._reserved, needs)):
            gen = self._pending.popleft()
            need = self._need(gen)
            self.prompt_cache.trim(self.policy.budget - self._reserved
                                   - need * gen.num_sequences)
            self._insert(gen, need)
        self._count()

    def _handle(self, item) -> bool:
        if item is None:
            return False
        if isinstance(item, _Submit):
            self._pending.append(item.gen)
            self._previous_arrival, self._last_arrival = self._last_arrival, \
                item.gen.submitted_at
        elif isinstance(item, _Cancel):
            uids = [u for u in item.gen.uids if u in self._seqs]
            if uids:
                self._remove(uids, keep_prefix=True)
                self.stats.cancelled_total += 1
            elif not item.gen.uids:  # never started: waiting (``_admit`` drops it), or
                # dropped already (its flag is set on the event loop, before this item
                # is read: counting only what was still pending lost those)
                self.stats.cancelled_total += 1
        self._count()
        return True

    def _remove(self, uids: list[int], keep_prefix: bool = False) -> None:
        """Take sequences out of the batch. A cancelled one (the client left, or its
        deadline passed) leaves what it prefilled in the prompt cache: the client's retry
        of a long prompt starts from there instead of paying the whole prefill again."""
        keep = keep_prefix and not self.config.sharded
        kept = self._bg.remove(uids, return_prompt_caches=True) if keep else \
            self._bg.remove(uids)
        for u in uids:
            seq = self._seqs.pop(u)
            self._reserved -= seq.reserved
            if keep and u in kept and seq.key is None:  # (images: keyed by their hashes)
                self._keep_prefix(*kept[u], seq.gen.cache_scope)

    def _keep_prefix(self, cache: Any, tokens: Any, scope: str) -> None:
        """Store a cancelled sequence's cache under the tokens it holds (the processed
        part of its prompt, and what it generated)."""
        if not cache:
            return
        held = {getattr(c, "offset", None) for c in cache}
        n = held.pop() if len(held) == 1 else None
        if not isinstance(n, int) or n <= 0:
            return  # layers that disagree, or state that is not per token: keep nothing
        ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        if len(ids) < n:
            return
        self.prompt_cache.store([int(t) for t in ids[:n]], cache,
                                self.policy.budget - self._reserved, scope)

    def _insert(self, gen: Generation, need: int) -> None:
        """Start ``gen``'s sequences, each reserving ``need`` bytes of KV."""
        p = gen.params
        try:
            prompts, caches, cached = [], [], []
            for pr in gen.prompts:
                for _ in range(gen.n):
                    if gen.vision is not None:
                        cache, rest, kind, done = self._fetch_vision(gen.vision,
                                                                     gen.cache_scope)
                    else:
                        cache, rest, kind = self.prompt_cache.fetch(list(pr), gen.cache_scope)
                        done = len(pr) - len(rest)
                    prompts.append(rest)
                    caches.append(cache)
                    cached.append(list(pr[:len(pr) - len(rest)]))
                    if gen.cache_hit is None:
                        gen.cache_hit = kind or "miss"
                        gen.cached_tokens = done
                        self._loop.call_soon_threadsafe(gen.admitted.set)
            count = gen.num_sequences
            procs = [logits_processors(p, self.tokenizer, self.vocab_size)
                     for _ in range(count)]
            skip = self._special if p.skip_special_tokens else frozenset()
            decoders = [SequenceDecoder(self.tokenizer, p.stop, skip, p.keep_leading_space)
                        for _ in range(count)]
            budget = p.max_tokens
            samplers = [self._samplers.get(p, i) for i in range(count)]
            if self._lone(gen, procs):
                first, cache = self._solo_first_token(gen, prompts[0], caches[0], decoders[0],
                                                      samplers[0])
                if first is None:
                    return  # finished with its first token
                prompts, caches, cached = [[first]], [cache], [list(gen.prompts[0])]
                budget -= 1
            recipe = {"recipe": (p, count)} if self.config.sharded else {}
            uids = self._bg.insert(
                prompts, **recipe,
                max_tokens=[budget] * count,
                caches=caches,
                all_tokens=cached,
                samplers=samplers,
                logits_processors=procs,
                stop_sequences=[self._no_stop] * count if p.ignore_eos else None,
            )
        except Rejected as e:
            self._post([(gen, EngineError(f"The model cannot read this input: {e}", 400))])
            return
        except Exception as e:  # noqa: BLE001 - bad parameters must not kill the engine
            log.warning("could not start a generation: %s", e)
            self._post([(gen, EngineError(f"{type(e).__name__}: {e}"))])
            return
        gen.uids = uids
        if self._speculator is not None and p.prediction:
            for uid in uids:
                self._speculator.predict(uid, p.prediction)
        if gen.phase == "queued":
            gen.phase, gen.started_at = "prefill", time.monotonic()
            self._count_request(gen)
        key = gen.vision.key if gen.vision is not None else None
        longest = max(len(pr) for pr in gen.prompts)
        for i, uid in enumerate(uids):
            self._seqs[uid] = _Seq(gen, i, need, decoders[i], procs[i], key, longest,
                                   longest, longest + min(p.max_tokens, RESERVE_TOKENS))
        self._reserved += need * len(uids)

    def _wants_logprobs(self, uid: int) -> bool:
        """Whether sequence ``uid``'s client asked for logprobs (the speculator's
        question)."""
        seq = self._seqs.get(uid)
        return seq is None or seq.gen.params.logprobs is not None

    def _first_token(self, gen: Generation) -> None:
        """``gen`` has its first token: it is generating, and its wait counts in the
        median time to first token (``ttft_p50_s``)."""
        gen.phase, gen.first_token_at = "generation", time.monotonic()
        self._waits.append((gen.first_token_at, gen.first_token_at - gen.submitted_at))

    def _count_request(self, gen: Generation) -> None:
        self.stats.requests_total += 1
        self.stats.prompt_tokens_total += sum(len(pr) for pr in gen.prompts) * gen.n

    def _lone(self, gen: Generation, procs: list) -> bool:
        """A request alone in an idle engine, plain enough for ``_solo_first_token``."""
        p = gen.params
        return (not self.config.sharded and not self._seqs and not self._pending
                and gen.num_sequences == 1
                and gen.vision is None and not procs[0] and p.logprobs is None)

    def _solo_first_token(self, gen: Generation, rest: list[int], cache: Optional[list],
                          decoder: SequenceDecoder, sampler: Any
                          ) -> tuple[Optional[int], list]:
        """A lone request's first token, sampled here from one forward pass over its whole
        prompt, and sent at once.

        ``BatchGenerator`` reads a prompt's last token in a pass of its own and computes
        the second token before handing out the first (docs/performance.md); for one
        person typing, that is two extra passes over the weights before anything shows.
        Here the first token leaves after one pass; the sequence then joins the batch like
        a prompt-cache hit (its cache holds the prompt, its next input is this token).
        Returns that token (None when the generation ended with it) and the cache."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        p = gen.params
        gen.phase, gen.started_at = "prefill", time.monotonic()
        self._count_request(gen)
        cache = cache if cache is not None else make_prompt_cache(self._model)
        x = mx.array(rest)[None]
        step = self.config.prefill_step_size
        # The logits of the prompt's positions are never computed (a prompt's worth of
        # vocabulary projections, most of the work on a small model with a large
        # vocabulary). With one pass, the last chunk goes through the model's body whole
        # and its head reads the last position; otherwise (or when the cache must be kept
        # as it was just before the last token) all but the last token fill the cache,
        # then the last token is read alone, as mlx-lm does.
        snapshot = self._snapshots and len(rest) > 1
        one_pass = self._one_pass and not snapshot
        while x.shape[1] > (step if one_pass else 1):
            n = min(step, x.shape[1] - 1)
            self._model(x[:, :n], cache=cache)
            mx.eval([c.state for c in cache])
            x = x[:, n:]
        if snapshot:  # the cache as the prompt's end left it
            self.prompt_cache.store(list(gen.prompts[0][:-1]), copy.deepcopy(cache),
                                    self.policy.budget - self._reserved, gen.cache_scope)
        with last_position_only(self._model) if one_pass else contextlib.nullcontext():
            logits = self._model(x, cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = int((sampler(logprobs) if sampler else mx.argmax(logprobs, axis=-1)).item())
        self.stats.steps += 1
        self.stats.generation_tokens_total += 1
        reason = "stop" if not p.ignore_eos and token in self.tokenizer.eos_token_ids else \
            "length" if p.max_tokens <= 1 else None
        text = decoder.feed(token, reason)
        gen.generated = 1
        self._first_token(gen)
        self._post([(gen, TokenEvent(0, token, text, decoder.finish_reason,
                                     decoder.stop_sequence))])
        if decoder.finish_reason is None:
            return token, [compact(c) for c in cache]  # as the batch takes a cache hit's
        self.prompt_cache.store(list(gen.prompts[0]), cache, self.policy.budget - self._reserved,
                                gen.cache_scope)
        return None, cache

    def _fetch_vision(self, vp, scope: str) -> tuple[list[Any], list[int], Optional[str], int]:
        """A prompt with images: the cached prefix, looked up by its key (image hashes in
        place of image tokens). When the cache does not cover every image, the prompt is
        read here from the first image on (vision tower and language model) and the batch
        gets the filled cache plus the last token, like a cache hit. Returns (cache,
        tokens for the batch, hit kind, prompt tokens served from the cache)."""
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        cache, rest, kind = self.prompt_cache.fetch(list(vp.key), scope)
        done = len(vp.ids) - len(rest)
        if done >= vp.last:  # every image is in the cached prefix: only text is left
            return cache, vp.ids[done:], kind, done
        start = min(done, vp.first)
        if cache is not None and start < done:
            trim_prompt_cache(cache, done - start)
        if cache is None or start == 0:
            cache, start = make_prompt_cache(self._model), 0
            kind = None if done == 0 else kind
        try:
            self.vision.prefill(vp.ids[start:-1], vp.features, cache,
                                self.config.prefill_step_size)
        except ValueError as e:  # mlx-vlm's word for input its architecture cannot take
            raise Rejected(str(e)) from None
        return cache, vp.ids[-1:], kind, start

    def _plan_prefill(self) -> bool:
        """Size mlx-lm's next prefill pass (``prefill_group``); True when this step only
        decodes, to hand the group that just finished prefilling its first tokens before
        the next group's prefill (``first_tokens_first``)."""
        bg = self._bg
        if self._prefill_alone or self.config.sharded:
            return self._joined and not self.config.sharded
        def left(segments: list) -> int:  # prompt tokens a sequence has yet to read
            return sum(len(s) for s in segments)

        # (mlx-lm's entries: a prompt's segments left, at [0] mid-prefill, [1] waiting)
        going = [e[0] for e in bg._currently_processing]
        waiting = [left(e[1]) for e in bg._unprocessed_sequences]
        group = self.policy.prefill_group([], waiting) if waiting else 1
        first = self.policy.first_tokens_first(-(-len(waiting) // group), self._decode_s,
                                               self._prefill_s)
        # A group at its last token joins the batch in this step: with first tokens first,
        # nothing new starts prefilling beside it (its first tokens would wait for that)
        joining = any(len(s) == 1 and len(s[0]) == 1 for s in going)
        if first and (joining or self._joined):
            bg.prefill_batch_size = len(going)
        elif waiting:
            bg.prefill_batch_size = self.policy.prefill_group(list(map(left, going)),
                                                              waiting)
        return first and self._joined

    def _step(self) -> None:
        alone = self._plan_prefill()
        t0 = time.perf_counter()
        if alone:
            prompts, responses = self._generation_only()
        else:
            prompts, responses = self._bg.next()
        self._time_step(time.perf_counter() - t0, prompts, responses)
        # Prompts that finished their prefill in that call: their first tokens come out of
        # the next call's generation step, which would then also prefill the next group of
        # prompts (seconds on a CPU) before returning them. Hand them out first.
        self._joined = any(r.end_of_prompt for r in prompts)
        if self._snapshots:
            self._snapshot([r.uid for r in prompts if r.end_of_segment and not r.end_of_prompt])
        self.stats.steps += 1
        out, stopped, broken = [], [], {}
        finished = {r.uid for r in responses if r.finish_reason is not None}
        for r in responses:
            seq = self._seqs.get(r.uid)
            if seq is None or seq.gen in broken:
                continue
            try:
                self._emit(r, seq, out, stopped)
            except Exception as e:  # noqa: BLE001 - this sequence's own failure: its alone
                log.exception("a sequence failed (the rest of the batch goes on)")
                broken[seq.gen] = e
        for gen, e in broken.items():  # fail that request, not its neighbours
            out = [(g, ev) for g, ev in out if g is not gen]
            out.append((gen, EngineError(f"Generation failed: {type(e).__name__}: {e}", 500)))
            gone = [u for u in gen.uids if u in self._seqs]
            stopped = [u for u in stopped if u not in gone]
            for u in gone:
                if u in finished:  # (the batch let it go already)
                    self._reserved -= self._seqs.pop(u).reserved
                else:
                    self._remove([u])
        if stopped:
            self._remove(stopped)
        self.stats.generation_tokens_total += len(responses)
        self._count()
        if out:
            self._post(out)

    def _emit(self, r: Any, seq: _Seq, out: list, stopped: list) -> None:
        """One response of a step: its token decoded and queued for its request, its
        slot and cache handed back when it finished."""
        import mlx.core as mx

        gen, dec = seq.gen, seq.decoder
        if dec.finish_reason is not None:
            return  # a stop string ended it earlier in this step (speculation)
        text = dec.feed(r.token, seq.finish_reason(r.finish_reason))
        ev = TokenEvent(seq.index, r.token, text, dec.finish_reason, dec.stop_sequence)
        k = gen.params.logprobs
        if k is not None:
            lp = r.logprobs
            ev.logprob = lp[r.token].item()
            if k > 0:
                top = mx.argpartition(-lp, kth=k - 1)[:k]
                ev.top_logprobs = sorted(zip(top.tolist(), lp[top].tolist()),
                                         key=lambda t: -t[1])
        failed = r.finish_reason is not None and seq.grammar_error()
        out.append((gen, EngineError(
            f"Structured output failed: the grammar engine stopped ({failed}); the "
            "answer would not match the schema.", 500) if failed else ev))
        gen.generated += 1
        seq.length += 1
        if seq.length > seq.reserved_length and r.finish_reason is None:
            self._grow(seq)
        if gen.first_token_at is None:
            self._first_token(gen)
        if r.finish_reason is not None:
            del self._seqs[r.uid]
            self._reserved -= seq.reserved
            if r.prompt_cache is not None:
                tokens = list(r.all_tokens)
                if seq.key is not None:  # images: stored under their hashes
                    tokens[:len(seq.key)] = seq.key
                self.prompt_cache.store(tokens, r.prompt_cache,
                                        self.policy.budget - self._reserved,
                                        seq.gen.cache_scope)
        elif dec.finish_reason is not None:  # a stop string: free its slot now
            stopped.append(r.uid)

    def _snapshot(self, uids: list[int]) -> None:
        """Keep the caches of prompts whose prefill just reached their last token (all of
        the prompt but that token), for the next request that extends the prompt."""
        uids = [u for u in uids if u in self._seqs and self._seqs[u].key is None]
        for u, (cache, tokens) in self._bg.extract_cache(uids).items():
            self.prompt_cache.store(list(tokens), cache, self.policy.budget - self._reserved,
                                    self._seqs[u].gen.cache_scope)

    def _time_step(self, seconds: float, prompts: list, responses: list) -> None:
        """Fold one step's time into the decode and prefill averages."""
        if any(not r.end_of_prompt for r in prompts):  # it prefilled prompt chunks
            extra = max(0.0, seconds - (self._decode_s if responses else 0.0))
            known = self._prefill_s < float("inf")
            self._prefill_s = self._prefill_s + 0.3 * (extra - self._prefill_s) if known \
                else extra
        elif responses:
            self._decode_s += 0.3 * (seconds - self._decode_s)

    def _generation_only(self) -> tuple[list, list]:
        """One step of mlx-lm's ``BatchGenerator`` that starts no new prompt: a decode
        step for the running sequences (prompts already mid-prefill go on). Measured at 32
        streams of 274-token prompts: each group of 8 got its first token one whole group
        prefill later (4-5 s on this CPU) than this."""
        size = self._bg.prefill_batch_size
        self._bg.prefill_batch_size = 0
        try:
            return self._bg.next()
        finally:
            self._bg.prefill_batch_size = size

    def _count(self) -> None:
        st = self.stats
        st.running = len(self._seqs)
        st.waiting = sum(g.num_sequences for g in self._pending)
        st.peak_running = max(st.peak_running, st.running)

    def _publish(self, force: bool = False) -> None:
        """Snapshot the status for the event loop (a new dict each time: readers on
        other threads only ever see a whole one)."""
        now = time.monotonic()
        if not force and now - self._published < REPORT_INTERVAL:
            return
        self._published = now
        spec = self._speculator
        recent = sorted(w for t, w in self._waits if now - t < 60)
        self.stats.ttft_p50_s = round(recent[len(recent) // 2], 3) if recent else 0.0
        self.report = {**_stats_dict(self.stats), "kv_reserved_bytes": self._reserved,
                         "paths": self.paths,
                         "speculation": spec.stats.as_dict() if spec else None,
                         "grammar": grammar_stats(),
                         "mlx_memory": {**mlx_memory(), "limit_bytes": self.memory_limit},
                         "prompt_cache": self.prompt_cache.status()}

    def _post(self, events: list[tuple[Generation, Any]]) -> None:
        self._loop.call_soon_threadsafe(_deliver, events)

    def _fail_active(self, message: str) -> None:
        gens = {s.gen for s in self._seqs.values()}
        self._seqs = {}
        self._post([(g, EngineError(message)) for g in gens])

    def _fail_pending(self) -> None:
        out = [(g, EngineError(self.error or "engine not running"))
               for g in getattr(self, "_pending", [])]
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Submit):
                out.append((item.gen, EngineError(self.error or "engine not running")))
        if out:
            self._post(out)


def _deliver(events: list[tuple[Generation, Any]]) -> None:
    for gen, ev in events:
        gen.events.put_nowait(ev)
        gen.admitted.set()  # (an error before admission: nobody waits for it forever)


def _stats_dict(st: EngineStats) -> dict[str, Any]:
    d = asdict(st)
    return {"steps_executed": d.pop("steps"), "num_running": d.pop("running"),
            "num_waiting": d.pop("waiting"),
            "generation_tokens_total": d.pop("generation_tokens_total"), **d}
