"""API keys, bind safety, rate and body limits, timeouts, metrics, /v1/status, request ids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import free_port
from served import Served, manifest, wait_for

from mlxfleet.api.guard import is_loopback

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": MSG, "max_tokens": 2}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    f = Served(tmp_path_factory.mktemp("sec"), env={"MLXFLEET_API_KEY": "k1, k2",
                                                   "MLXFLEET_ENABLE_METRICS": "1",
                                                   "MLXFLEET_MAX_BODY_MB": "1",
                                                   "MLXFLEET_BODY_TIMEOUT": "2",
                                                   "MLXFLEET_DEFAULT_CACHE_MB": "256"})
    f.write("tiny.yaml", manifest("tiny"))
    f.write("slow.yaml", manifest("slow", source="builtin:tiny-10m",
                                  limits={"timeout": "2s"}))
    f.write("long.yaml", manifest("long", source="builtin:tiny-10m"))
    f.start()
    f.wait_ready("tiny")
    f.wait_ready("long")
    yield f
    f.stop()


def auth(key: str = "k1") -> dict:
    return {"Authorization": f"Bearer {key}"}


ROUTES = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}),
    ("POST", "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": MSG}),
    ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": MSG}),
    ("POST", "/v1/embeddings", {"model": "tiny", "input": "x"}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/status", None),
    ("GET", "/mlxfleet/v1/models", None),
    ("GET", "/mlxfleet/v1/models/tiny", None),
    ("GET", "/mlxfleet/v1/models/tiny/logs", None),
    ("POST", "/mlxfleet/v1/models/tiny/load", None),
    ("POST", "/api/chat", {"model": "tiny", "messages": MSG, "stream": False,
                           "options": {"num_predict": 2}}),
    ("POST", "/api/generate", {"model": "tiny", "prompt": "x", "options": {"num_predict": 2}}),
    ("GET", "/api/tags", None),
    ("GET", "/api/ps", None),
    ("POST", "/api/show", {"model": "tiny"}),
    ("GET", "/v1/mcp/status", None),
    ("GET", "/v1/mcp/tools", None),
    ("POST", "/v1/mcp/execute", {"server": "x", "tool": "y", "arguments": {}}),
]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_every_route_requires_a_key(secured, method, path, body):
    url = secured.url + path
    for headers in ({}, auth("wrong"), {"x-api-key": "nope"}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        if path.startswith("/v1/messages"):
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.json()["type"] == "error"
        elif path.startswith("/api/"):  # Ollama's shape
            assert "API key" in r.json()["error"], r.text
        else:
            assert r.json()["error"]["code"] == "invalid_api_key"
    for headers in (auth("k1"), {"x-api-key": "k2"}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=60)
        assert r.status_code != 401, r.text


def test_health_stays_open_and_cli_uses_the_key(secured):
    assert httpx.get(secured.url + "/health").status_code == 200
    ok = secured.cli("get", "models")
    assert ok.returncode == 0 and "tiny" in ok.stdout
    env_less = subprocess.run([sys.executable, "-m", "mlxfleet", "get", "models", "--server",
                               secured.url], capture_output=True, text=True, timeout=60)
    assert env_less.returncode != 0 and "API key" in env_less.stderr


def test_body_size_limit_is_a_413(secured):
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = httpx.post(secured.url + "/v1/chat/completions", json=big, headers=auth(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def stalled_stream(secured, path: str, body: dict) -> str:
    """A stream whose worker stops (SIGSTOP) after its first tokens: the text received."""
    pid = secured.status("slow")["pid"]
    got = []
    try:
        with httpx.stream("POST", secured.url + path, headers=auth(), timeout=60,
                          json=body) as r:
            for chunk in r.iter_text():
                got.append(chunk)
                if len(got) == 3:
                    os.kill(pid, signal.SIGSTOP)  # alive, but sends nothing more
    finally:
        os.kill(pid, signal.SIGCONT)
    return "".join(got)


def test_the_timeout_cuts_a_stalled_stream_not_a_producing_one(secured):
    h = auth()
    assert wait_for(lambda: httpx.post(secured.url + "/mlxfleet/v1/models/slow/load",
                                       headers=h, timeout=120).status_code == 200, 120)
    # Tokens keep coming for longer than the 2 s timeout: the answer is not cut.
    with httpx.stream("POST", secured.url + "/v1/chat/completions", headers=h, timeout=60,
                      json={"model": "slow", "messages": MSG, "max_tokens": 400,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 400
    # A stream that stalls for 2 s ends with the timeout, in-band, and frees the slot.
    t0 = time.monotonic()
    text = stalled_stream(secured, "/v1/chat/completions", {
        "model": "slow", "messages": MSG, "max_tokens": 1900, "stream": True})
    lines = [ln for ln in text.splitlines() if ln]
    assert time.monotonic() - t0 < 15
    assert lines[-1] == "data: [DONE]" and '"code":"timeout"' in lines[-2].replace(" ", "")

    def idle():
        s = httpx.get(secured.url + "/v1/status", headers=h).json()["models"]["slow"]
        return s.get("num_running") == 0 and not s.get("requests")

    assert wait_for(idle, 10)
    # Not streamed, the timeout is the whole request's.
    r = httpx.post(secured.url + "/v1/chat/completions", headers=h, timeout=60,
                   json={"model": "slow", "messages": MSG, "max_tokens": 1900})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    # On the Anthropic route the in-band error is Anthropic's error event.
    text = stalled_stream(secured, "/v1/messages", {
        "model": "slow", "messages": MSG, "max_tokens": 1900, "stream": True})
    last = text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ") and "[DONE]" not in text
    err = json.loads(last.split("data: ", 1)[1])
    assert err["type"] == "error" and err["error"]["type"] == "api_error"
    assert "timed out" in err["error"]["message"]


def test_status_shows_a_running_request_in_its_phase(secured):
    h = {**auth(), "X-Request-Id": "trace-me-42"}
    httpx.post(secured.url + "/mlxfleet/v1/models/slow/load", headers=h, timeout=120)
    seen, done = {}, threading.Event()

    def stream():
        with httpx.stream("POST", secured.url + "/v1/chat/completions", headers=h, timeout=60,
                          json={"model": "slow", "messages": MSG, "max_tokens": 1900,
                                "stream": True}) as r:
            seen["id"] = r.headers.get("X-Request-Id")
            for _ in r.iter_lines():
                if done.is_set():
                    break  # seen running: hang up rather than wait for 1900 tokens

    t = threading.Thread(target=stream)
    t.start()

    def running():
        reqs = httpx.get(secured.url + "/v1/status", headers=auth()).json()["models"]["slow"]
        reqs = reqs.get("requests") or []
        return next((q for q in reqs if q["phase"] == "generation"), None)

    q = wait_for(running, 10, 0.05)
    done.set()
    t.join(60)
    assert q and q["request_id"] == "trace-me-42" and q["generated_tokens"] > 0
    assert q["max_tokens"] == 1900 and 0 < q["progress"] < 1 and q["ttft_s"] > 0
    assert seen["id"] == "trace-me-42"
    # (logged when the worker hears of the hang-up, a moment later)
    assert wait_for(lambda: "request trace-me-42:" in secured.cli(
        "logs", "slow", "--tail", "200").stdout, 20, 0.5)


def scrape(served: Served) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(served.url + "/metrics").text  # opt-in, unauthenticated
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return sum(v for (n, lb), v in m.items()
               if n == name and all(dict(lb).get(k) == x for k, x in labels.items()))


def test_metrics_parse_and_move(secured):
    before = scrape(secured)
    for _ in range(3):
        assert httpx.post(secured.url + "/v1/chat/completions", json=CHAT,
                          headers=auth()).status_code == 200
    after = scrape(secured)
    req = "mlxfleet_requests_total"
    assert value(after, req, model="tiny", status="200") - \
        value(before, req, model="tiny", status="200") == 3
    toks = "mlxfleet_engine_completion_tokens_total"
    assert value(after, toks, model="tiny") - value(before, toks, model="tiny") >= 6
    assert value(after, "mlxfleet_model_loaded", model="tiny") == 1
    assert value(after, "mlxfleet_request_duration_seconds_count", model="tiny") >= 3


def test_a_client_that_hangs_up_counts_as_499_and_stops_its_generation(secured):
    """On ``long`` (builtin:tiny-10m: 1900 tokens take seconds, so a client that leaves
    after 2 s leaves mid-generation, however loaded the machine)."""
    def cancelled() -> int:
        st = httpx.get(secured.url + "/v1/status", headers=auth()).json()
        return st["models"]["long"]["cancelled_total"]

    before, was = scrape(secured), cancelled()
    long = {**CHAT, "model": "long", "max_tokens": 1900, "ignore_eos": True}
    for _ in range(2):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(secured.url + "/v1/chat/completions", headers=auth(), timeout=2.0,
                       json=long)
    with httpx.stream("POST", secured.url + "/v1/chat/completions", headers=auth(),
                      json={**long, "stream": True}) as r:
        next(r.iter_lines())  # the stream has started; now hang up
    assert wait_for(lambda: value(scrape(secured), "mlxfleet_inflight_requests") == 0, 20)
    after = scrape(secured)
    req = "mlxfleet_requests_total"
    moved = {lb: v - before.get((n, lb), 0) for (n, lb), v in after.items()
             if n == req and v != before.get((n, lb), 0)}
    assert value(after, req, model="long", status="499") - \
        value(before, req, model="long", status="499") == 3, moved
    assert "client disconnected (499)" in secured.logs()
    # The worker stopped generating for each (1900 tokens would have taken much longer).
    assert wait_for(lambda: cancelled() - was == 3, 10), cancelled() - was


def test_a_client_that_hangs_up_mid_body_leaves_no_error_in_the_log(secured):
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(secured.url)
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n"
                  b"Authorization: Bearer " + auth()["Authorization"][7:].encode() +
                  b"\r\n\r\n{\"model\": ")
    time.sleep(0.5)
    assert httpx.get(secured.url + "/health").status_code == 200
    assert "Exception in ASGI application" not in secured.logs()
    assert "Traceback" not in secured.logs()


def test_the_server_default_cache_budget_reaches_the_worker(secured):
    s = httpx.get(secured.url + "/v1/status", headers=auth()).json()["models"]["tiny"]
    assert s["prompt_cache"]["budget_bytes"] == 256 << 20


SEED_COUNTERS = ("steps_executed", "num_running", "num_waiting", "total_requests_processed",
                 "total_prompt_tokens", "total_completion_tokens")
SEED_REQUEST = ("request_id", "phase", "tokens_per_second", "ttft_s", "progress",
                "cache_hit_type", "cached_tokens", "generated_tokens", "max_tokens")


def test_status_has_vllm_mlx_documented_shape(secured):
    import threading

    r = httpx.post(secured.url + "/v1/chat/completions", headers=auth(), json=CHAT, timeout=30)
    assert r.status_code == 200
    hold = threading.Thread(target=lambda: httpx.post(
        secured.url + "/v1/chat/completions", headers=auth(), timeout=60,
        json={**CHAT, "model": "long", "max_tokens": 200, "ignore_eos": True}))  # (no 2 s limit)
    hold.start()
    s = wait_for(lambda: (x := httpx.get(secured.url + "/v1/status", headers=auth())
                          .json())["requests"] and x, 20)  # the one seen with a request
    hold.join()
    assert s, "no request showed up in /v1/status"
    assert s["status"] == "running" and s["model"] == ["long", "slow", "tiny"]
    assert s["uptime_s"] > 0
    for key in SEED_COUNTERS:
        assert isinstance(s[key], int) and s[key] >= 0, key
    done = r.json()["usage"]["completion_tokens"]
    assert s["total_requests_processed"] >= 1 and s["total_completion_tokens"] >= done > 0
    assert set(s["metal"]) == {"active_memory_gb", "peak_memory_gb", "cache_memory_gb"}
    assert s["metal"]["active_memory_gb"] > 0
    assert set(s["cache"]) == {"type", "entries", "hit_rate", "memory_mb"}
    assert 0 <= s["cache"]["hit_rate"] <= 1
    (req,) = [q for q in s["requests"] if q["model"] == "long"]
    assert set(SEED_REQUEST) <= set(req)
    assert req["phase"] in ("queued", "prefill", "generation") and req["max_tokens"] == 200
    assert req["cache_hit_type"] in (None, "exact", "prefix", "supersequence", "lcp", "miss")
    # Each model has the same shape, under models.
    tiny = s["models"]["tiny"]
    assert tiny["status"] == "running" and tiny["model"] == "tiny"
    assert all(k in tiny for k in (*SEED_COUNTERS, "metal", "cache", "requests"))


def test_client_keys_read_and_infer_only_the_admin_key_changes_models(tmp_path):
    f = Served(tmp_path, env={"MLXFLEET_API_KEY": "client", "MLXFLEET_ADMIN_KEY": "admin"})
    f.write("tiny.yaml", manifest("tiny", preload=False))
    f.start()
    try:
        client, admin = auth("client"), auth("admin")
        base = f.url + "/mlxfleet/v1"
        assert httpx.get(base + "/models", headers=client).status_code == 200
        r = httpx.post(base + "/models/tiny/load", headers=client, timeout=120)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert httpx.post(base + "/manifests", headers=client,
                          content=manifest("x")).status_code == 403
        assert httpx.delete(base + "/models/tiny", headers=client).status_code == 403
        assert httpx.post(base + "/models/tiny/load", headers={}).status_code == 401
        assert httpx.post(base + "/models/tiny/load", headers=admin,
                          timeout=120).status_code == 200
        for key in (client, admin):  # both may infer
            assert httpx.post(f.url + "/v1/chat/completions", headers=key, json=CHAT,
                              timeout=60).status_code == 200
        # The CLI prefers MLXFLEET_ADMIN_KEY.
        assert f.cli("unload", "tiny").returncode == 0
    finally:
        f.stop()


def test_rate_limit_gives_429_with_retry_after(tmp_path):
    f = Served(tmp_path, env={"MLXFLEET_RATE_LIMIT": "3"})
    f.write("tiny.yaml", manifest("tiny"))
    f.start()
    try:
        f.wait_ready("tiny")
        codes = [httpx.post(f.url + "/v1/chat/completions", json=CHAT).status_code
                 for _ in range(4)]
        assert codes[:3] == [200, 200, 200] and codes[3] == 429
        r = httpx.post(f.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) > 0
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert httpx.get(f.url + "/health").status_code == 200  # not limited
    finally:
        f.stop()


def test_non_loopback_bind_without_a_key_is_refused(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mlxfleet", "serve", "--host", "0.0.0.0",
                        "--port", str(free_port()), "--manifests", str(tmp_path),
                        "--state-dir", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "without an API key" in r.stderr
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")


@pytest.mark.parametrize("change, field", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"seed": 1 << 64}, "seed"),
    ({"tools": [{"type": "function", "function": ["not", "an", "object"]}]}, "tools"),
    ({"tools": [{"type": "function", "function": "get_weather"}]}, "tools"),
    ({"keep_alive": "99999999999d"}, "keep_alive"),
])
def test_client_mistakes_are_400s_naming_the_field(secured, change, field):
    r = httpx.post(secured.url + "/v1/chat/completions", headers=auth(), timeout=30,
                   json={**CHAT, **change})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(field)


def test_a_body_that_never_finishes_gets_a_408(secured):
    import json
    import socket

    with socket.create_connection(("127.0.0.1", secured.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                  b"Authorization: Bearer k1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny\"")
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert json.loads(body)["error"]["code"] == "request_timeout"
    r = httpx.post(secured.url + "/v1/chat/completions", headers=auth(), timeout=30, json=CHAT)
    assert r.status_code == 200, r.text


def test_nan_keep_alive_and_deep_json_are_400s_and_status_still_works(secured):
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], ' \
           '"max_tokens": 2, "keep_alive": NaN}'
    r = httpx.post(secured.url + "/v1/chat/completions", content=body, timeout=30,
                   headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
    deep = '{"model": "tiny", "x": ' + "[" * 5000 + "]" * 5000 + "}"
    for path in ("/v1/chat/completions", "/v1/messages"):
        r = httpx.post(secured.url + path, content=deep, timeout=30,
                       headers={**auth(), "Content-Type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.text
    assert secured.cli("get", "models").returncode == 0
    assert httpx.get(secured.url + "/mlxfleet/v1/models/tiny", headers=auth()).status_code \
        == 200


def test_a_negative_seed_works(secured):
    r = httpx.post(secured.url + "/v1/chat/completions", headers=auth(), timeout=30,
                   json={**CHAT, "seed": -5, "temperature": 0.8})
    assert r.status_code == 200, r.text


def test_a_non_ascii_request_id_is_replaced_not_a_500(secured):
    r = httpx.post(secured.url + "/v1/chat/completions", timeout=30, json=CHAT,
                   headers={**auth(), "X-Request-Id": "caf\u00e9".encode()})
    assert r.status_code == 200 and r.headers["X-Request-Id"].isascii()


def test_metrics_label_routes_by_template(secured):
    for i in range(30):
        httpx.get(f"{secured.url}/no/such/path/{i}", headers=auth())
        httpx.get(f"{secured.url}/mlxfleet/v1/models/nope{i}", headers=auth())
    routes = {dict(lb).get("route") for (n, lb) in scrape(secured)
              if n == "mlxfleet_requests_total"}
    assert "<unmatched>" in routes and "/mlxfleet/v1/models/<name>" in routes
    assert not any(r and ("/no/such" in r or "nope" in r) for r in routes)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_get_no_api_key_and_logs_are_private(secured):
    import os
    import stat

    pid = secured.status("tiny")["pid"]
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    assert not any(e.startswith(b"MLXFLEET_API_KEY=") for e in env)
    log = secured.status("tiny")["logFile"]
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(log)).st_mode) == 0o700
