"""The ``mlxfleet`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path
from typing import Optional


def _default_name(source: str) -> str:
    base = source.split(":", 1)[-1].rstrip("/").split("/")[-1]
    return re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-") or "model"


def _add_worker(sub) -> None:
    p = sub.add_parser("worker", help="run one model worker in the foreground",
                       description="Serve one MLX model over the OpenAI API.")
    p.add_argument("--source", required=True,
                   help="builtin:NAME, a local model directory, or a Hugging Face repo id")
    p.add_argument("--name", help="model name clients send as `model` (default: from source)")
    p.add_argument("--bind", default="127.0.0.1:8001",
                   help="unix:PATH or HOST:PORT (default 127.0.0.1:8001)")
    p.add_argument("--revision", help="Hugging Face revision (branch, tag or commit)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--max-concurrency", type=int, default=16,
                   help="sequences decoded together in one batch (default 16)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait beyond max-concurrency before 503")
    p.add_argument("--prefill-batch-size", type=int, default=8)
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=512,
                   help="default completion length when a request sets none")
    p.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (400 beyond)")
    p.add_argument("--temperature", type=float, default=1.0, help="default temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="default top_p")
    p.add_argument("--top-k", type=int, default=0, help="default top_k (0 = off)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests")


def _run_worker(args) -> int:
    from .worker.completions import ModelDefaults
    from .worker.engine import EngineConfig
    from .worker.server import WorkerOptions, run_worker

    for flag in ("max_concurrency", "prefill_batch_size", "prefill_step_size", "max_tokens"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    opts = WorkerOptions(
        source=args.source,
        name=args.name or _default_name(args.source),
        bind=args.bind,
        engine=EngineConfig(max_concurrency=args.max_concurrency,
                            prefill_batch_size=args.prefill_batch_size,
                            prefill_step_size=args.prefill_step_size,
                            revision=args.revision,
                            trust_remote_code=args.trust_remote_code),
        defaults=ModelDefaults(max_tokens=args.max_tokens,
                               max_tokens_limit=args.max_tokens_limit,
                               temperature=args.temperature, top_p=args.top_p,
                               top_k=args.top_k),
        max_queue=args.max_queue,
        drain_timeout=args.drain_timeout,
    )
    return run_worker(opts)


def _run_make_model(args) -> int:
    from .worker.builtin import BUILTIN_SIZES, write_builtin
    from .worker.sources import BUILTIN_PREFIX

    name = args.source[len(BUILTIN_PREFIX):] if args.source.startswith(BUILTIN_PREFIX) \
        else args.source
    if name not in BUILTIN_SIZES:
        print(f"error: unknown builtin model {args.source!r}; choose one of: "
              + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_SIZES), file=sys.stderr)
        return 2
    out = write_builtin(name, Path(args.dir))
    print(f"wrote {BUILTIN_PREFIX}{name} to {out}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mlxfleet",
                                     description="Serve local LLMs with MLX from YAML manifests.")
    parser.add_argument("--log-level", default=os.environ.get("MLXFLEET_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    _add_worker(sub)
    p = sub.add_parser("make-model", help="write a builtin model to a directory")
    p.add_argument("source", help="builtin:tiny, builtin:tiny-10m, builtin:tiny-50m")
    p.add_argument("dir", help="output directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return {"worker": _run_worker, "make-model": _run_make_model}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
