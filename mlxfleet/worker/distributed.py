"""A model sharded over several workers with MLX distributed (engine thread only).

Every rank holds a shard of the weights (mlx-lm's ``sharded_load``: tensor parallel
through the model's ``shard()``, or pipeline parallel) and every forward pass needs
all of them at once. Rank 0 serves HTTP and runs the engine as usual; before each
operation on its ``BatchGenerator`` (insert, remove, step) it sends the operation to
the other ranks, which do the same on theirs (``follow``), so the collectives inside
the model line up. A rank that loses a peer exits: the supervisors restart the
group. Limits, by design: no prompt cache (each rank would have to hold the same
entries of its own shard), no images, no lone-request shortcut.

This is how mlx_lm.server shares requests between ranks (a pickled object sent with
``all_sum``); here it is every batch operation, because our engine decides stops,
cancellations and admissions on rank 0.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import tempfile
import time
from typing import Any, Optional

log = logging.getLogger("mlxfleet.worker")

#: Exit code of a rank whose group broke (a peer died): the supervisor restarts it.
GROUP_LOST = 75


def init_group(cfg: Any) -> Any:
    """Join the group (blocks until every rank has joined), and agree on one random
    state so that sampling gives the same tokens on every rank."""
    import mlx.core as mx

    fd, path = tempfile.mkstemp(prefix="mlxfleet-hosts-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[h] for h in cfg.dist_hosts], f)
    os.environ["MLX_HOSTFILE"] = path
    os.environ["MLX_RANK"] = str(cfg.dist_rank)
    log.info("rank %d of %d: joining the group (%s, %s)", cfg.dist_rank, len(cfg.dist_hosts),
             cfg.dist_backend, ", ".join(cfg.dist_hosts))
    group = mx.distributed.init(backend=cfg.dist_backend, strict=True)
    os.unlink(path)
    seed = mx.distributed.all_sum(mx.random.state[0], group=group, stream=mx.cpu)
    mx.random.seed(seed.view(mx.uint64).item())
    log.info("rank %d of %d: joined", group.rank(), group.size())
    return group


def load_sharded(path: str, cfg: Any, group: Any, tokenizer_config: dict):
    """The model's shard for this rank, its tokenizer and config."""
    from mlx_lm.utils import sharded_load

    tensor = group if cfg.dist_strategy == "tensor" else None
    pipeline = group if cfg.dist_strategy == "pipeline" else None
    return sharded_load(path, pipeline, tensor, return_config=True,
                        tokenizer_config=tokenizer_config,
                        trust_remote_code=cfg.trust_remote_code)


class Channel:
    """Rank 0 sends small Python objects to every other rank, in order."""

    def __init__(self, group: Any):
        self.group = group

    def send(self, obj: Any) -> None:
        import mlx.core as mx

        data = mx.array(memoryview(pickle.dumps(obj)), dtype=mx.uint8)
        mx.eval(mx.distributed.all_sum(mx.array(data.size), group=self.group, stream=mx.cpu))
        mx.eval(mx.distributed.all_sum(data, group=self.group, stream=mx.cpu))

    def receive(self) -> Any:
        import mlx.core as mx

        size = mx.distributed.all_sum(mx.array(0), group=self.group, stream=mx.cpu).item()
        data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=self.group,
                                      stream=mx.cpu)
        return pickle.loads(bytes(memoryview(data)))


class MirroredBatch:
    """Rank 0's ``BatchGenerator``: each operation goes to the other ranks first."""

    def __init__(self, bg: Any, channel: Channel):
        self.bg, self.channel = bg, channel

    def insert(self, prompts, *, recipe: tuple, **kw) -> list[int]:
        """``recipe`` (sampling params, sequences) rebuilds the samplers and logits
        processors there; they are functions and do not travel."""
        self.channel.send(("insert", prompts, kw["max_tokens"], kw["all_tokens"], recipe))
        return self.bg.insert(prompts, **kw)

    def remove(self, uids: list[int]) -> None:
        self.channel.send(("remove", uids))
        self.bg.remove(uids)

    def next(self):
        self.channel.send(("next",))
        return self.bg.next()

    def ping(self) -> None:
        """Keep an idle group's connections in use."""
        self.channel.send(("ping",))

    def close(self) -> None:
        self.channel.send(("stop",))


def follow(engine: Any, channel: Channel) -> None:
    """A rank other than 0: do what rank 0 does to its batch, until it says stop."""
    from .sampling import logits_processors

    bg = engine._bg
    while not engine._stop:
        msg = channel.receive()
        op = msg[0]
        engine.heartbeat = time.monotonic()
        if op == "insert":
            _, prompts, max_tokens, all_tokens, (p, count) = msg
            bg.insert(prompts, max_tokens=max_tokens, caches=[None] * count,
                      all_tokens=all_tokens,
                      samplers=[engine._samplers.get(p, i) for i in range(count)],
                      logits_processors=[logits_processors(p, engine.tokenizer,
                                                           engine.vocab_size)
                                         for _ in range(count)],
                      stop_sequences=[engine._no_stop] * count if p.ignore_eos else None)
        elif op == "remove":
            bg.remove(msg[1])
        elif op == "next":
            bg.next()
        elif op == "stop":
            return


class NoPromptCache:
    """The prompt cache of a sharded model: none (see the module's docstring)."""

    def fetch(self, tokens: list[int], scope: str = "") -> tuple[None, list[int], Optional[str]]:
        return None, tokens, None

    def store(self, *args: Any) -> None:
        return None

    def trim(self, budget: int) -> None:
        return None

    def flush(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"entries": 0, "bytes": 0, "budget_bytes": 0, "hits": {}, "misses": 0,
                "cached_tokens_total": 0, "evictions": 0, "disk_hits": 0, "disk": None,
                "disabled": "sharded model"}
