"""The worker's OpenAI API through the official ``openai`` SDK, against a real worker
process serving the builtin tiny model (random weights: text is gibberish, but
greedy decoding is deterministic and token counts are exact)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import openai
import pytest
from served import in_parallel

MSGS = [{"role": "user", "content": "What is the capital of Japan?"}]


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=worker.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from tokenizers import Tokenizer

    from mlxfleet.builtin import ensure_builtin

    return Tokenizer.from_file(str(ensure_builtin("tiny") / "tokenizer.json"))


@pytest.fixture
def aclient(worker):
    return openai.AsyncOpenAI(base_url=worker.base_url + "/v1", api_key="unused",
                              max_retries=0)


def _stream_chat(client, **kw) -> tuple[str, str, list]:
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    return text, finish[-1], chunks


def test_health_and_models(worker):
    with worker.client() as c:
        h = c.get("/health").json()
        assert h["status"] == "ok" and h["model"] == "tiny"
        models = c.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_chat_greedy_is_deterministic_and_streaming_matches(client):
    kw = dict(model="tiny", messages=MSGS, max_tokens=24, temperature=0)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content  # the model said something
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 24
    assert a.usage.total_tokens == a.usage.prompt_tokens + 24
    assert a.object == "chat.completion" and a.model == "tiny" and a.id.startswith("chatcmpl-")
    text, finish, chunks = _stream_chat(client, **kw)
    assert text == a.choices[0].message.content
    assert finish == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id for c in chunks)


async def test_async_client_matches_sync(client, aclient):
    kw = dict(model="tiny", messages=MSGS, max_tokens=16, temperature=0)
    sync = client.chat.completions.create(**kw).choices[0].message.content
    got = await aclient.chat.completions.create(**kw)
    assert got.choices[0].message.content == sync
    stream = await aclient.chat.completions.create(stream=True, **kw)
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == sync


def test_completions_stream_and_not(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0)
    a = client.completions.create(**kw)
    assert a.object == "text_completion" and a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 20
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == a.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # Token-id prompts give the same result as the text they encode.
    echo = client.completions.create(echo=True, **kw)
    assert echo.choices[0].text == "Once upon a time" + a.choices[0].text


def test_include_usage_adds_final_usage_chunk(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_and_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, n=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1  # greedy: all the same
    assert r.usage.completion_tokens == 18
    lp = r.choices[0].logprobs.content
    assert len(lp) == 6
    for item in lp:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        # greedy picks the most likely token
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
    c = client.completions.create(model="tiny", prompt="abc", max_tokens=4, logprobs=1,
                                  temperature=0)
    assert len(c.choices[0].logprobs.token_logprobs) == 4


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model="tiny", messages=MSGS, max_tokens=24, temperature=1.5)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=8, **kw).choices[0].message.content
    assert a == b
    assert a != c


def test_alone_or_in_a_batch_the_answer_is_the_same(client):
    """A request alone in an idle engine takes its first token in a pass of its own
    (the lone-request fast path) and then joins the batch; with others running it starts
    in the batch. Either way a seed gives the same text, and so does greedy decoding."""
    def ask(seed=None, temperature=1.5):
        return client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=24, temperature=temperature,
            seed=seed).choices[0].message.content

    alone = [ask(seed=11), ask(temperature=0)]
    busy = in_parallel(ask, [(11,), (None, 0), (12,), (13,)])
    assert busy[:2] == alone


def test_stop_strings_are_cut_and_end_the_choice(client):
    kw = dict(model="tiny", messages=MSGS, max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    stop = full[10:14]
    expected = full[: full.find(stop)]
    r = client.chat.completions.create(stop=[stop, "never-appears"], **kw)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    text, finish, _ = _stream_chat(client, stop=stop, **kw)
    assert text == expected and finish == "stop"


def test_penalties_and_extra_sampling_parameters_change_output(client):
    base = dict(model="tiny", messages=MSGS, max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**base).choices[0].message.content
    penalised = client.chat.completions.create(
        frequency_penalty=2.0, presence_penalty=2.0,
        extra_body={"repetition_penalty": 1.5, "top_k": 5, "min_p": 0.05}, **base)
    # Random weights repeat themselves under greedy decoding; penalties must bite.
    assert penalised.choices[0].message.content != plain


def test_logit_bias_forces_a_token(client, tiny_tokenizer):
    for word in ("Paris", "blue", "42"):
        tid = tiny_tokenizer.encode(word).ids[0]
        r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=1,
                                      temperature=0, logit_bias={str(tid): 100})
        assert r.choices[0].text == tiny_tokenizer.decode([tid])


def test_special_tokens_are_hidden_unless_asked_for(worker, client, tiny_tokenizer):
    start = tiny_tokenizer.token_to_id("<|im_start|>")
    kw = dict(model="tiny", messages=MSGS, max_tokens=3, temperature=0,
              logit_bias={str(start): 100})
    hidden = client.chat.completions.create(**kw)
    assert "<|im_start|>" not in (hidden.choices[0].message.content or "")
    assert hidden.usage.completion_tokens == 3  # generated, just not shown
    text, _, _ = _stream_chat(client, **kw)
    assert "<|im_start|>" not in text
    shown = client.chat.completions.create(extra_body={"skip_special_tokens": False}, **kw)
    assert shown.choices[0].message.content == "<|im_start|>" * 3


def test_chat_message_has_openais_required_refusal_field(worker):
    with worker.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS,
                                                 "max_tokens": 2})
    msg = r.json()["choices"][0]["message"]
    assert "refusal" in msg and msg["refusal"] is None


def test_embeddings_on_a_chat_model_say_so(worker, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="hello")
    assert e.value.status_code == 400 and "not an embedding model" in str(e.value)


async def test_16_concurrent_streams_are_batched_with_exact_counts(worker, aclient):
    before = worker.status()

    async def one(i: int):
        max_tokens = 150 + 10 * i
        stream = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Request {i}"}],
            max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        finish, used = None, None
        async for c in stream:
            if c.choices and c.choices[0].finish_reason:
                finish = c.choices[0].finish_reason
            if c.usage:
                used = c.usage.completion_tokens
        return max_tokens, finish, used

    results = await asyncio.gather(*(one(i) for i in range(16)))
    for max_tokens, finish, used in results:
        assert finish == "length"
        assert used == max_tokens
    after = worker.status()
    tokens = sum(r[0] for r in results)
    steps = after["steps_executed"] - before["steps_executed"]
    # Run one at a time this would take `tokens` decode steps; batched, about
    # as many as the longest request.
    assert steps < tokens / 4, (steps, tokens)
    assert after["peak_running"] == 16


def test_stream_interval_groups_tokens_into_fewer_chunks(client):
    kw = dict(model="tiny", messages=MSGS, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    text, finish, chunks = _stream_chat(client, extra_body={"stream_interval": 4}, **kw)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert text == full and finish == "length"
    assert 1 <= len(content) <= 3  # 12 tokens in chunks of 4
    comp = list(client.completions.create(model="tiny", prompt="abc", max_tokens=10,
                                          temperature=0, stream=True,
                                          extra_body={"stream_interval": 5}))
    assert len([c for c in comp if c.choices]) <= 2


def test_mlxfleet_bench_counts_every_token_of_every_stream(worker):
    """``mlxfleet bench``: its figures are the server's usage, every stream's, no error."""
    r = subprocess.run([sys.executable, "-m", "mlxfleet", "bench", "--url", worker.base_url,
                        "--model", "tiny", "-c", "3", "-n", "5", "--max-tokens", "12",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["errors"] == 0 and report["output_tokens"] == 5 * 12
    assert 0 < report["ttft_ms"]["p50"] <= report["wall_s"] * 1000
    bad = subprocess.run([sys.executable, "-m", "mlxfleet", "bench", "--url", worker.base_url,
                          "--model", "tiny", "-c", "2", "-n", "2", "--max-tokens", "0",
                          "--json"],
                         capture_output=True, text=True, timeout=120)
    report = json.loads(bad.stdout)
    assert bad.returncode == 1 and report["errors"] == 2  # every request failed: said so
    assert report["first_error"].startswith("HTTP 400")


def test_with_no_max_tokens_an_answer_runs_to_the_context_not_512(start_worker):
    """Codex sends no max_output_tokens and cn no max_tokens: with no limit from the
    client, an answer may use the context left (it was cut at 512), bounded by the
    operator's max_request_tokens where one is set. Its KV is reserved as it grows, so
    such a request does not hold the budget of the whole context from its start."""
    import openai

    w = start_worker("--context-length", "640", "--max-concurrency", "4",
                     source="builtin:tiny-10m")
    c = openai.OpenAI(base_url=w.base_url + "/v1", api_key="unused")
    r = c.chat.completions.create(model="tiny", temperature=0, extra_body={"ignore_eos": True},
                                  messages=[{"role": "user", "content": "Tell me a story."}])
    assert r.usage.completion_tokens == 640 - r.usage.prompt_tokens > 512, r.usage
    assert r.choices[0].finish_reason == "length"
    assert w.status()["kv_reserved_bytes"] == 0
    capped = start_worker("--context-length", "640", "--max-request-tokens", "100",
                          source="builtin:tiny-10m")
    c = openai.OpenAI(base_url=capped.base_url + "/v1", api_key="unused")
    r = c.chat.completions.create(model="tiny", temperature=0, extra_body={"ignore_eos": True},
                                  messages=[{"role": "user", "content": "Tell me a story."}])
    assert r.usage.completion_tokens == 100
    capped.stop()
    w.stop()
