"""Issue #46's and #43's GPU checks in one command, within one device call.

    bash .gpu/run.sh benchmarks/gpu_suite.py --out "$OUT" [--budget 540] [--only exit tiny]

(`.gpu/` from `bash ../shared/gpu/prepare.sh`; ``../shared/gpu/README.md``.) A session is
lent a GPU for 15 minutes in all and 10 a command, so the steps run most needed first, each
under its own time limit, and a step that would not fit the time left is skipped (said in
the summary). Each step's output goes to ``OUT/<step>.txt`` (compare.py's tables also to
``OUT/<step>.md``) as it runs, so a run cut short keeps what it finished.

Steps:
- ``exit``: a worker on builtin:tiny answers one request and is stopped with SIGTERM; it
  must exit 0 without "terminate called" (issue #46: workers aborted on CUDA).
- ``tiny``: compare.py on builtin:tiny-50m at 1, 8, 32 and 128 streams (raw loop,
  mlx_lm.server, worker, gateway, the first burst after Ready, the lone request).
- ``big``: the same on a 1.4B Qwen3-shaped bf16 model (``synthetic_model.py``).
- ``spec``: speculative.py at 32 and 128 streams, speculation off against auto.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from compare import free_port, wait_http

HERE = Path(__file__).resolve().parent
PY = sys.executable


def run(cmd: list[str], log: Path, limit: float) -> str:
    """Run ``cmd`` with its output in ``log``; the outcome in a few words."""
    t0 = time.monotonic()
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(limit)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return f"cut at its limit ({limit:.0f} s)"
    return f"exit {rc} in {time.monotonic() - t0:.0f} s"


def exit_check(log: Path) -> str:
    """A worker that served one request exits 0 on SIGTERM, without an abort."""
    import httpx

    port = free_port()
    with open(log, "wb") as f:
        w = subprocess.Popen([PY, "-m", "mlxfleet", "worker", "--source", "builtin:tiny",
                              "--bind", f"127.0.0.1:{port}"], stdout=f,
                             stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health", timeout=120)
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "max_tokens": 8,
                "messages": [{"role": "user", "content": "hello"}]})
            answered = r.status_code
        finally:
            w.send_signal(signal.SIGTERM)
            try:
                rc = w.wait(60)
            except subprocess.TimeoutExpired:
                w.kill()
                rc = "hung (killed after 60 s)"
    aborted = "terminate called" in log.read_text(errors="replace")
    ok = answered == 200 and rc == 0 and not aborted
    return (f"{'ok' if ok else 'FAILED'}: answered {answered}, exit {rc}, "
            f"{'an abort in its output' if aborted else 'no abort'}")


def big(compare: list[str], shape: list[str], out: Path, log: Path, limit: float) -> str:
    """compare.py on the synthetic model (1.4B unless ``shape`` says otherwise), written
    first (its time counts)."""
    model = Path("/tmp/mlxfleet-synthetic" + "".join(shape).replace("--", "-"))
    t0 = time.monotonic()
    if not (model / "model.safetensors").exists():
        made = run([PY, str(HERE / "synthetic_model.py"), str(model), *shape],
                   out / "big-make.txt", min(120, limit))
        if not made.startswith("exit 0"):
            return f"the model was not written ({made})"
    return run(compare + ["--model", str(model), "--latency-requests", "20",
                          "--write", str(out / "big.md")], log,
               limit - (time.monotonic() - t0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-results")))
    ap.add_argument("--budget", type=float, default=540, help="seconds for all steps")
    ap.add_argument("--only", nargs="+", choices=["exit", "tiny", "big", "spec"])
    ap.add_argument("--streams", nargs="+", default=["1", "8", "32", "128"],
                    help="compare.py's stream counts")
    ap.add_argument("--big-shape", default="", help="synthetic_model.py's shape options "
                    "(default: its 1.4B)")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    compare = [PY, str(HERE / "compare.py"), "--streams", *args.streams]
    # (step, the least time it needs, its limit, what it runs)
    steps = [
        ("exit", 20, 90, None),
        ("tiny", 100, 200, compare + ["--model", "builtin:tiny-50m", "--latency-requests",
                                      "50", "--write", str(out / "tiny.md")]),
        ("big", 150, 260, None),
        ("spec", 60, 150, [PY, str(HERE / "speculative.py"), "--streams", "32", "128",
                           "--repeats", "1", "--servers", "mlxfleet, speculation off",
                           "mlxfleet"]),
    ]
    summary = []
    for name, least, limit, cmd in steps:
        if args.only and name not in args.only:
            continue
        left = args.budget - (time.monotonic() - t0)
        if left < least:
            summary.append(f"{name}: skipped ({left:.0f} s left, needs {least})")
            print(summary[-1], flush=True)
            continue
        log = out / f"{name}.txt"
        limit = min(limit, left)
        if name == "exit":
            outcome = exit_check(log)
        elif name == "big":
            outcome = big(compare, args.big_shape.split(), out, log, limit)
        else:
            outcome = run(cmd, log, limit)
        summary.append(f"{name}: {outcome}")
        print(summary[-1], flush=True)
        (out / "summary.txt").write_text("\n".join(summary) + "\n")


if __name__ == "__main__":
    main()
