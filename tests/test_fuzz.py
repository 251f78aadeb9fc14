"""Generated request bodies against every public model route: never a 5xx, every error in
the route's protocol shape, and the server still answers afterwards (hypothesis, on a time
budget)."""

from __future__ import annotations

import base64
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from served import Served, manifest

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages",
          "/v1/messages/count_tokens", "/v1/embeddings", "/api/chat", "/api/generate",
          "/api/embed", "/v1/responses"]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stop_sequences", "n", "stream",
          "logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "logit_bias",
          "system", "keep_alive", "echo", "stream_options", "input", "parallel_tool_calls",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
          "options", "format", "think", "raw", "template", "suffix", "images",
          "instructions", "text", "reasoning", "max_output_tokens", "store",
          "previous_response_id"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(
        ["role", "content", "type", "text", "name", "function", "arguments", "parameters",
         "json_schema", "schema", "id", "input", "tool_use_id"]), inner, max_size=4)),
    max_leaves=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
     "content": st.one_of(st.text(max_size=30), values)}), max_size=3)
bodies = st.builds(
    lambda model, fields, msgs: {"model": model, "messages": msgs, "max_tokens": 3,
                                 **fields},
    st.sampled_from(["tiny", "nope", "", "default"]),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=5), messages)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    f = Served(tmp_path_factory.mktemp("fuzz"))
    f.write("tiny.yaml", manifest("tiny", aliases=["default"], keepAlive="forever"))
    f.start()
    f.wait_ready("tiny")
    yield f
    f.stop()


@pytest.mark.parametrize("route", ROUTES)
def test_generated_bodies_never_get_a_5xx(served, route):
    client = httpx.Client(base_url=served.url, timeout=60)

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def check(body):
        if route.startswith("/api/") and isinstance(body.get("options", {}), dict):
            body["options"] = {**body.get("options", {}), "num_predict": 3}  # keep it short
        if route == "/v1/responses":
            body.setdefault("input", body.pop("messages"))
            body.setdefault("max_output_tokens", 3)
        r = client.post(route, json=body)
        assert r.status_code < 500 or r.status_code == 503, (body, r.status_code, r.text)
        if r.status_code >= 400:
            err = r.json()
            if route.startswith("/v1/messages"):
                assert err["type"] == "error" and err["error"]["message"], err
            elif route.startswith("/api/"):
                assert isinstance(err["error"], str) and err["error"], err
            else:
                assert err["error"]["message"] and "type" in err["error"], err

    check()
    assert client.post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]}).status_code == 200


def test_generated_manifests_never_get_a_5xx(served):
    client = httpx.Client(base_url=served.url, timeout=60)
    docs = st.one_of(st.text(max_size=200), values.map(lambda v: __import__("yaml").safe_dump(
        {"apiVersion": "mlxfleet/v1", "kind": "Model", "metadata": {"name": "fz"},
         "spec": v})))

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(docs)
    def check(text):
        r = client.post("/mlxfleet/v1/manifests", content=text.encode(),
                        headers={"Content-Type": "application/yaml"})
        assert r.status_code < 500, (text, r.text)
        if r.status_code == 200:  # it was a valid model: take it away again
            client.delete("/mlxfleet/v1/models/fz")

    check()
    assert served.status("tiny")["ready"]


KEYS = st.sampled_from(["a", "b", "c"])
schemas = st.recursive(
    st.one_of(st.just({}), st.sampled_from([{"type": t} for t in (
        "string", "integer", "number", "boolean", "null", "object", "array")]),
        st.builds(lambda p: {"type": "string", "pattern": p}, st.text("ab[]{}()*+?^$|.\\1-9",
                                                                      max_size=12)),
        st.builds(lambda v: {"enum": v}, st.lists(scalars, min_size=1, max_size=5)),
        st.just({"$ref": "#"})),
    lambda inner: st.one_of(
        st.builds(lambda props, req: {"type": "object", "properties": props, "required": req},
                  st.dictionaries(KEYS, inner, max_size=3), st.lists(KEYS, max_size=3)),
        st.builds(lambda items, n: {"type": "array", "items": items, "minItems": n},
                  inner, st.integers(0, 3)),
        st.builds(lambda opts: {"anyOf": opts}, st.lists(inner, max_size=3))),
    max_leaves=8)


def test_generated_schemas_parse_or_are_refused(served):
    """Structured output: whatever the schema, a 400 that says why, or an answer that
    parses (even when max_tokens cuts it), and the worker lives on."""
    client = httpx.Client(base_url=served.url, timeout=60)
    pid = served.status("tiny")["pid"]

    @settings(max_examples=int(os.environ.get("FUZZ_SCHEMAS", 40)), deadline=None,
              database=None, suppress_health_check=list(HealthCheck))
    @given(schemas, st.integers(4, 40))
    def check(schema, max_tokens):
        r = client.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}})
        assert r.status_code in (200, 400), (schema, r.status_code, r.text)
        if r.status_code == 200:
            json.loads(r.json()["choices"][0]["message"]["content"])
        else:
            assert r.json()["error"]["code"] in ("invalid_schema", "invalid_value"), r.text

    check()
    s = served.status("tiny")
    assert s["ready"] and s["pid"] == pid


def test_generated_images_never_get_a_5xx(served):
    client = httpx.Client(base_url=served.url, timeout=60)

    @settings(max_examples=30, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=300), st.sampled_from(["image/png", "image/jpeg", "text/x"]))
    def check(data, mime):
        uri = f"data:{mime};base64," + base64.b64encode(data).decode()
        r = client.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "text", "text": "what is it?"}]}]})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text

    check()
    assert served.status("tiny")["ready"]
