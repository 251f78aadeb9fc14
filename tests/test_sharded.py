"""A model sharded over two nodes with MLX distributed (ring backend on 127.0.0.1): two
`mlxfleet serve --node` processes, each starting its rank; rank 0 serves."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from conftest import free_port
from served import Served, in_parallel, manifest, wait_for
from test_nodes import ENV, KEY, node_doc

PROMPTS = ["Tell me a story about a dragon", "What is 2 + 2?", "List three colors",
           "Write a haiku about rain"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ns = Served.nodes(tmp_path_factory.mktemp("sharded"), "ab", ENV)
    ns["a"].write("nodes.yaml", "---\n".join(
        node_doc(n, ns[n].url, "8GB") for n in "ab"))
    ns["a"].write("models.yaml", "---\n".join([
        manifest("sharded", distributed={"nodes": ["a", "b"], "port": free_port()}),
        manifest("whole", placement={"nodes": ["b"]})]))
    Served.start_all(ns)
    yield ns
    for n in ns.values():
        n.stop()


def answer(node: Served, model: str, prompt: str, max_tokens: int = 24) -> str:
    r = node.openai().chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0)
    return r.choices[0].message.content


def follower_pid(node: Served) -> int:
    """The pid of the rank worker ``node`` runs for 'sharded' (from its node report)."""
    from mlxfleet.fleet_auth import sign

    rep = httpx.get(node.url + "/mlxfleet/v1/node", timeout=5,
                    headers=sign(KEY, "test", "GET", "/mlxfleet/v1/node")).json()
    st = {m["name"]: m for m in rep["models"]}.get("sharded") or {}
    return st.get("pid") if st.get("ready") else None


def test_sharded_output_equals_the_unsharded_model_token_for_token(pair):
    a, b = pair["a"], pair["b"]
    models = wait_for(lambda: (lambda m: m if m["sharded"]["ready"] else None)(a.models()),
                      120)
    assert models, (a.models(), a.logs(), b.logs())
    assert models["sharded"]["node"] == "a" and models["sharded"]["pid"]
    assert wait_for(lambda: follower_pid(b), 30), b.logs()
    for p in PROMPTS:
        whole = answer(a, "whole", p)
        assert answer(a, "sharded", p) == whole, p
        assert answer(b, "sharded", p) == whole, p  # routed from b to rank 0 on a
    # together, in one batch on both ranks, with different lengths
    together = in_parallel(lambda p, n: answer(b, "sharded", p, n),
                           [(p, 8 + 6 * i) for i, p in enumerate(PROMPTS)])
    alone = [answer(a, "whole", p, 8 + 6 * i) for i, p in enumerate(PROMPTS)]
    assert together == alone
    # stop strings end a sequence on rank 0, which tells the other rank to drop it
    r = a.openai().chat.completions.create(
        model="sharded", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=24,
        temperature=0, stop=[answer(a, "whole", PROMPTS[0])[4:7]])
    assert r.choices[0].finish_reason == "stop"
    assert answer(b, "sharded", PROMPTS[1]) == answer(a, "whole", PROMPTS[1])


def test_a_dead_rank_restarts_the_group(pair):
    a, b = pair["a"], pair["b"]
    expected = answer(a, "whole", PROMPTS[2])
    pid = wait_for(lambda: follower_pid(b), 30)
    os.kill(pid, signal.SIGKILL)
    new = wait_for(lambda: (lambda p: p if p and p != pid else None)(follower_pid(b)), 120)
    assert new, b.logs()
    ok = wait_for(lambda: a.models()["sharded"]["ready"], 120)
    assert ok, a.logs()

    def served():
        try:
            return answer(b, "sharded", PROMPTS[2])
        except Exception:  # noqa: BLE001 - the group may still be forming
            return None

    assert wait_for(served, 120, interval=1) == expected, (a.logs(), b.logs())
