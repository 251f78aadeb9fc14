"""A burst of clients at once: however many arrive together, each is answered or told to
come back (a 503 with Retry-After from the queue limit), never failed by a socket.

512 streaming requests at once overflowed the worker's accept queue (its listen backlog):
16 of 512 failed with ``502 ... cannot connect to .../1.sock: [Errno 11] Resource
temporarily unavailable``. The gateway now connects to a worker a few at a time and waits
its turn when the queue is full; the worker listens with room for every request it takes.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from served import Served, manifest

from mlxfleet.supervisor.process import PRIMED_CONNECTIONS


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    f = Served(tmp_path_factory.mktemp("burst"))
    f.write("tiny.yaml", manifest("tiny", batching={"maxConcurrency": 256, "maxQueue": 1024},
                                  cache={"memoryMB": 512}))
    try:
        f.start()
        f.wait_ready("tiny")
        yield f
    finally:
        f.stop()


def _connections_to(sock: Path) -> int:
    """Connected sockets a worker accepted on ``sock`` (Linux lists them in /proc/net/unix
    under the listening socket's path, state 03; the listening one is 01)."""
    rows = Path("/proc/net/unix").read_text().splitlines()[1:]
    return sum(1 for r in rows if r.endswith(" " + str(sock)) and r.split()[5] == "03")


@pytest.mark.skipif(sys.platform != "linux", reason="reads the kernel's socket table")
def test_the_gateway_opens_connections_to_a_worker_as_it_becomes_ready(served):
    # A first burst after Ready finds connections open instead of paying to open them
    # (issue #46): before any request, the worker already holds the gateway's pool.
    (sock,) = served.run_dir.glob("mlxfleet-*/*.sock")
    assert _connections_to(sock) >= PRIMED_CONNECTIONS


def test_512_streams_at_once_are_all_answered(served):
    body = {"model": "tiny", "max_tokens": 4, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Hello there"}]}

    async def one(client: httpx.AsyncClient) -> tuple[int, bool]:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            text = (await r.aread()).decode()
            return r.status_code, text.rstrip().endswith("data: [DONE]") and \
                '"error"' not in text

    async def burst() -> list[tuple[int, bool]]:
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=600)
        async with httpx.AsyncClient(base_url=served.url, limits=limits,
                                     timeout=httpx.Timeout(300, pool=300)) as client:
            return await asyncio.gather(*(one(client) for _ in range(512)))

    results = asyncio.run(burst())
    codes = sorted({c for c, _ in results})
    assert codes == [200], (codes, served.logs()[-3000:])
    assert all(done for _, done in results), served.logs()[-3000:]
    assert "Resource temporarily unavailable" not in served.logs()
