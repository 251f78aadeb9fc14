"""Every model family, served exactly: the zoo's tiny checkpoints (mlx-lm's real
architectures with random weights, real tokenizers and chat templates) through real worker
processes, on every cache and batching path, give the token ids mlx-lm gives generating
each prompt alone (greedy)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import free_port
from served import in_parallel

from mlxfleet.builtin import builtin_cache_dir
from mlxfleet.worker.model_facts import kv_cost
from mlxfleet.worker.policy import AdmissionPolicy
from mlxfleet.zoo import FAMILIES, build

N = 12  # tokens generated per request
SYSTEM = "You are a helpful assistant who answers briefly, precisely and politely. " * 6
HELLO = [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": "Hello there, how are you today?"}]
LONGER = HELLO + [{"role": "assistant", "content": "Fine, thanks. What can I do for you?"},
                  {"role": "user", "content": "Tell me about the weather in Paris. " * 3}]


@pytest.fixture(scope="module")
def zoo_root():
    return builtin_cache_dir().parent / "zoo"


def real_ids_only(tok, rows: int):
    """A logits processor for mlx-lm alone: -inf at the rows the tokenizer has no id for
    (the zoo's checkpoints have more rows than ids, as real ones do; the server masks
    them, and so must the reference)."""
    import numpy as np

    m = np.full(rows, -np.inf, dtype=np.float32)
    m[[i for i in tok.get_vocab().values() if i < rows]] = 0.0
    mask = mx.array(m)
    return lambda tokens, logits: logits + mask.astype(logits.dtype)


@functools.cache  # (tiny models: each family is loaded once)
def reference(path: str, tokenizer_of: str | None = None):
    """mlx-lm alone on the checkpoint: (model, tokenizer, greedy ids for a prompt);
    the tokenizer already loaded for ``tokenizer_of`` (a build of the same family)."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    from mlxfleet.worker.tokenizer_json import quick_tokenizer_json

    if tokenizer_of is not None:  # (building a tokenizer is most of a load: 1-2 s)
        model, tok = load_model(Path(path))[0], reference(tokenizer_of)[1]
    else:
        with quick_tokenizer_json():  # (the same tokenizer, without parsing its JSON whole)
            model, tok = load(path)
    rows = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    model.real_ids_only = real_ids_only(tok, rows)

    @functools.lru_cache(maxsize=64)
    def alone(prompt: tuple[int, ...], n: int = N) -> list[int]:
        steps = generate_step(mx.array(prompt), model, max_tokens=n,
                              sampler=lambda x: mx.argmax(x, axis=-1),
                              logits_processors=[model.real_ids_only])
        return [int(t) for t, _ in steps]

    return model, tok, alone


def greedy(w, path: str, **body) -> dict:
    """A greedy answer of N tokens from worker ``w``, with its token ids."""
    with w.client() as c:
        r = c.post(path, json={"model": "m", "max_tokens": N, "temperature": 0,
                               "ignore_eos": True, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(w, messages, **kw) -> dict:
    return greedy(w, "/v1/chat/completions", messages=messages, **kw)


def complete(w, prompt, **kw) -> dict:
    return greedy(w, "/v1/completions", prompt=prompt, **kw)


def cached(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def batch_prompts(tok) -> list[list[int]]:
    """Four prompts of different lengths, to decode together."""
    return [tok.apply_chat_template(
        [{"role": "user", "content": "Tell me about cities and rivers. " * k}],
        add_generation_prompt=True) for k in (1, 3, 6, 10)]


def start(start_worker, path, *extra, config=None):
    config = {"speculative": "auto", **(config or {})}  # drafts must not change a token
    return start_worker("--config", json.dumps({"source": str(path), **config}),
                        "--name", "m", "--max-concurrency", "8", *extra, source=str(path))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_gives_mlx_lm_tokens_alone_again_longer_batched_and_from_disk(
        family, zoo_root, start_worker, tmp_path):
    path = build(family, zoo_root)
    model, tok, alone = reference(str(path))
    # A KV budget the four prompts below fill while they run: every retained prompt cache
    # leaves memory for the disk tier then, and the last request reads it back. (The disk
    # tier's files outliving the worker is tested once, in test_disk_cache.py: what is
    # per family is the round trip of its caches.)
    cost = kv_cost(model)
    policy = AdmissionPolicy(1, cost.per_token, 1, kv_windows=cost.windows,
                             kv_fixed=cost.fixed, prefill_step=512)
    budget = sum(policy.need(len(p), N) for p in batch_prompts(tok))
    disk = {"disk_cache_bytes": 1 << 30, "disk_cache_dir": str(tmp_path / "disk"),
            "cache_bytes": budget}
    w = start(start_worker, path, config=disk)
    first = chat(w, HELLO)
    prompt = tuple(first["prompt_token_ids"])
    assert first["choices"][0]["token_ids"] == alone(prompt), "alone"
    again = chat(w, HELLO)
    assert again["choices"][0]["token_ids"] == alone(prompt), "again (cache hit)"
    assert cached(again) >= 32
    longer = chat(w, LONGER)  # shares HELLO's prefix, runs past any sliding window (16)
    assert longer["choices"][0]["token_ids"] == alone(tuple(longer["prompt_token_ids"])), \
        "a longer prompt sharing the prefix"
    shared = next((i for i, (a, b) in enumerate(zip(prompt, longer["prompt_token_ids"]))
                   if a != b), len(prompt))
    if shared > 32:  # (Mistral's template moves the system prompt to the last user turn)
        assert cached(longer) >= 32
    # Four prompts of different lengths in one request, so that they surely run together
    # (and their KV fills the budget, for the disk tier); the other paths below send them
    # as four requests at once.
    prompts = batch_prompts(tok)
    together = sorted(complete(w, prompts)["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in together] == [alone(tuple(p)) for p in prompts], \
        "four prompts of different lengths at once"
    # a completion's text is its tokens' text, leading space and all
    body = complete(w, "The capital of France is", logprobs=0)
    choice = body["choices"][0]
    assert choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
    offsets, tokens = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    status = w.status()
    paths = status["paths"]
    assert paths["model_type"] == model.args.model_type
    # Speculation where every cache can be cut back to a row's length.
    assert paths["speculation"].startswith("off") != kv_only(path), paths["speculation"]
    assert (status["speculation"] is None) != kv_only(path)
    back = chat(w, HELLO)
    assert back["choices"][0]["token_ids"] == alone(prompt), "from the disk tier"
    assert cached(back) >= 32
    assert w.status()["prompt_cache"]["disk_hits"] >= 1
    w.stop()


def kv_only(path) -> bool:
    from mlxfleet.worker.model_facts import cache_kinds

    return cache_kinds(reference(str(path))[0]) == ["KVCache"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_gives_mlx_lm_tokens_with_the_paged_cache(family, zoo_root, start_worker):
    path = build(family, zoo_root)
    if not kv_only(path):
        pytest.skip("layers that are not plain KV caches keep whole prompts (tested above)")
    _, tok, alone = reference(str(path))
    w = start(start_worker, path, "--use-paged-cache")
    for messages in (HELLO, HELLO, LONGER):
        body = chat(w, messages)
        assert body["choices"][0]["token_ids"] == alone(tuple(body["prompt_token_ids"]))
        if messages is HELLO:
            hit = cached(body)
    assert hit >= 64  # (the paged cache shares whole 64-token blocks)
    prompts = batch_prompts(tok)
    together = in_parallel(lambda p: complete(w, p), [(p,) for p in prompts])
    assert [b["choices"][0]["token_ids"] for b in together] == \
        [alone(tuple(p)) for p in prompts]
    w.stop()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_gives_mlx_lm_tokens_tensor_parallel_over_two_ranks(
        family, zoo_root, start_worker):
    path = build(family, zoo_root)
    model, tok, alone = reference(str(path))
    if not hasattr(model, "shard"):
        pytest.skip(f"mlx-lm cannot shard {model.args.model_type}")
    hosts = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    ranks = []
    for r in (0, 1):
        cfg = json.dumps({"source": str(path), "dist_hosts": hosts, "dist_rank": r})
        ranks.append(start_worker("--config", cfg, "--name", "m", source=str(path),
                                  wait=False))
    ranks[0].wait_ready()
    try:
        body = chat(ranks[0], HELLO)
    except AssertionError as e:  # (the other rank's side of it, for the record)
        raise AssertionError(f"{e}\nrank 1:\n{ranks[1].logs()[-3000:]}") from None
    assert body["choices"][0]["token_ids"] == alone(tuple(body["prompt_token_ids"]))
    prompts = batch_prompts(tok)
    together = in_parallel(lambda p: complete(ranks[0], p), [(p,) for p in prompts])
    assert [b["choices"][0]["token_ids"] for b in together] == \
        [alone(tuple(p)) for p in prompts]
    for r in ranks:
        r.stop()


def test_the_zoo_is_built_from_the_families_real_tokenizers(zoo_root):
    """Each checkpoint carries its family's tokenizer and a chat template that renders."""
    for family in FAMILIES:
        path = build(family, zoo_root)
        config = json.loads((path / "config.json").read_text())
        assert config["mlxfleet"]["zoo"] == family
        assert os.path.getsize(path / "tokenizer.json") > 1_000_000  # a real vocabulary


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_kv_estimate_is_what_a_sequence_holds(family, zoo_root):
    """Admission budgets a sequence by ``kv_cost``: for MLA (a latent per token), sliding
    windows (bounded), hybrids (constant state beside attention) it must be what the
    cache really holds after a long prompt (512 tokens: whole allocation steps)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = reference(str(build(family, zoo_root)))[0]
    cost = kv_cost(model)
    cache = make_prompt_cache(model)
    model(mx.arange(1, 513)[None], cache=cache)
    mx.eval([c.state for c in cache])
    held = sum(c.nbytes for c in cache)
    policy = AdmissionPolicy(1 << 40, cost.per_token, 1, kv_windows=cost.windows,
                             kv_fixed=cost.fixed, prefill_step=512)
    assert policy.need(500, 12) == held


def test_the_context_length_counts_a_rope_scaling_that_stretches_it():
    from mlxfleet.worker.model_facts import context_length

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length({"max_position_embeddings": 40960, "rope_scaling": yarn}, None) \
        == 131072  # Qwen3 with YaRN, as its model card enables it
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert context_length({"max_position_embeddings": 131072, "rope_scaling": llama3},
                          None) == 131072  # already the stretched length
    assert context_length({"text_config": {"max_position_embeddings": 32768}}, None) == 32768


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
THOUGHT = "The user wants the weather, so I call the tool."


def split(splitter_of, text: str, streamed: bool) -> tuple[str, str, list]:
    """(content, reasoning, calls) a parser makes of ``text``, fed whole or a character
    at a time (as a stream arrives)."""
    sp = splitter_of()
    pieces = []
    for chunk in (list(text) if streamed else [text]):
        pieces += sp.feed(chunk)
    pieces += sp.finish()
    content = "".join(v for k, v in pieces if k == "content")
    reasoning = "".join(v for k, v in pieces if k == "reasoning")
    return content, reasoning, [v for k, v in pieces if k == "call"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_what_a_family_template_writes_its_parsers_read_back(family, zoo_root):
    """The assistant turn the family's own template writes (a tool call, reasoning), fed
    through the parsers picked for that model, streamed and whole, gives back the call
    and the reasoning exactly."""
    from mlxfleet.formats import pick_parsers
    from mlxfleet.worker.parsers import think_markers, tool_format
    from mlxfleet.worker.prompts import OutputPlan, for_template, template_style

    model, tok, _ = reference(str(build(family, zoo_root)))
    template, style = template_style(tok.chat_template)  # as the worker reads it at load
    tok.chat_template = template
    parsers = pick_parsers(model.args.model_type, template)
    if "tool" not in template:
        pytest.skip(f"{family}'s chat template cannot write tool calls")
    plan = OutputPlan(tool_format=tool_format(parsers.tool_call, tok),
                      think=think_markers(parsers.reasoning, tok),
                      harmony=parsers.tool_call == "harmony")
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    turn = {"role": "assistant", "content": "", "reasoning_content": THOUGHT,
            "tool_calls": [{"id": "call_0123456789abcdef01234567", "type": "function",
                            "function": {"name": "get_weather",
                                         "arguments": {"city": "Paris"}}}]}
    prompt = tok.apply_chat_template(asked, tools=TOOLS, add_generation_prompt=True,
                                     tokenize=False)
    full = tok.apply_chat_template(for_template(asked + [turn], style), tools=TOOLS,
                                   tokenize=False)
    assert full.startswith(prompt)
    written = full[len(prompt):]
    ends = [tok.convert_ids_to_tokens(i) for i in tok.eos_token_ids]
    written = written[:min([written.find(e) for e in ends if e in written] or [len(written)])]
    for streamed in (False, True):
        content, reasoning, calls = split(lambda: plan.splitter(TOOLS), written, streamed)
        assert calls == [CALL], (written, content)
        assert content.strip() == ""
        if THOUGHT in written:  # (templates that write the reasoning back)
            assert reasoning.strip() == THOUGHT
    # the next turn's prompt keeps the call and carries the tool's result
    result = {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567",
              "name": "get_weather",
              "content": "sunny, 24 C"}
    then = tok.apply_chat_template(for_template(asked + [turn, result], style), tools=TOOLS,
                                   add_generation_prompt=True, tokenize=False)
    assert "sunny, 24 C" in then and "Paris" in then[len(prompt):]
    # reasoning off: a template that closes the thought in the prompt starts in content
    if "enable_thinking" in template:
        off = tok.apply_chat_template(asked, add_generation_prompt=True, tokenize=False,
                                      enable_thinking=False)
        assert not off.rstrip().endswith(plan.think[0])
    if family == "gpt_oss":  # reasoning_effort goes into harmony's system message
        high = tok.apply_chat_template(asked, add_generation_prompt=True, tokenize=False,
                                       reasoning_effort="high")
        assert "Reasoning: high" in high


HARMONY_SCRIPT = {"rules": [
    {"when": "sunny", "say": "<|channel|>analysis<|message|>It is sunny."
     "<|end|><|start|>assistant<|channel|>final<|message|>Sunny in Paris."},
    {"when": "weather", "say": "<|channel|>analysis<|message|>I need the weather tool."
     "<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
     "<|message|>{\"city\": \"Paris\"}"}]}


def test_harmony_reasoning_calls_and_answers_reach_clients_and_the_choice_is_shown(
        tmp_path):
    """gpt-oss's harmony format end to end through the gateway and the openai SDK,
    streamed and not: the analysis channel is reasoning, a message to functions.NAME a
    call, the final channel the answer. (The scripted model writes harmony: random
    weights do not.) The parsers picked are shown in /v1/models, /api/show, describe."""
    import httpx
    from served import Served, manifest

    script = tmp_path / "script.json"
    script.write_text(json.dumps(HARMONY_SCRIPT))
    f = Served(tmp_path / "node")
    f.write("m.yaml", manifest("oss", source="builtin:scripted",
                               parsers={"toolCall": "harmony"},
                               env={"MLXFLEET_SCRIPT": str(script)}))
    f.start()
    try:
        f.wait_ready("oss")
        client = f.openai()
        asked = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = client.chat.completions.create(model="oss", messages=asked, tools=TOOLS,
                                           max_tokens=80)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert msg.reasoning_content == "I need the weather tool."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] \
            == [("get_weather", {"city": "Paris"})]
        assert not msg.content
        then = asked + [msg.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                         "content": "sunny", "name": "functions.get_weather"}]
        chunks = list(client.chat.completions.create(model="oss", messages=then, tools=TOOLS,
                                                     max_tokens=80, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        thought = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                          for c in chunks if c.choices)
        assert (text, thought) == ("Sunny in Paris.", "It is sunny.")
        listed = {m["id"]: m for m in httpx.get(f.url + "/v1/models").json()["data"]}
        assert listed["oss"]["parsers"]["tool_call"] == "harmony"
        assert listed["oss"]["parsers"]["source"] == "manifest"
        show = httpx.post(f.url + "/api/show", json={"model": "oss"}).json()
        assert show["parsers"] == {"tool_call": "harmony", "reasoning": "harmony",
                                   "source": "manifest"}
        out = f.cli("describe", "model", "oss")
        assert "Parsers:       tool calls harmony, reasoning harmony" in out.stdout, out
    finally:
        f.stop()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_with_a_quantized_kv_cache_gives_mlx_lm_quantized_tokens(
        family, zoo_root, start_worker):
    """``spec.cache.kvBits: 4``: the batch quantizes keys and values as mlx-lm's
    ``QuantizedKVCache`` does for one prompt alone (the reference), through prompt-cache
    hits and a batch of prompts of different lengths; families whose caches cannot be
    quantized (not all plain key/value ones; MLA) keep full precision, and say why."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    from mlxfleet.worker.quantized_cache import quantization_group

    path = build(family, zoo_root, head_dim=32)  # (quantization groups are 32 or more)
    model, tok, _ = reference(str(path), tokenizer_of=str(build(family, zoo_root)))
    group, why = quantization_group(model, 4)
    if model.args.model_type in ("deepseek_v3", "qwen3_next", "gemma3_text", "gpt_oss",
                                 "lfm2", "nemotron_h", "gemma4_text", "qwen3_5",
                                 "qwen3_5_moe", "kimi_linear", "granitemoehybrid",
                                 "glm4_moe_lite", "deepseek_v32", "falcon_h1", "olmo3",
                                 "exaone4"):
        assert group is None and why, why
        return
    assert group == 32, why
    w = start(start_worker, path, config={"kv_bits": 4})
    paths = w.status()["paths"]
    assert paths["kv_cache"] == "quantized to 4 bits (groups of 32)", paths
    assert paths["kv"]["bytes_per_token"] * 2.5 < kv_cost(model).per_token

    def quantized(prompt) -> list[int]:
        cache = [QuantizedKVCache(group, 4) for _ in model.layers]
        steps = generate_step(mx.array(prompt), model, max_tokens=N, prompt_cache=cache,
                              sampler=lambda x: mx.argmax(x, axis=-1),
                              logits_processors=[model.real_ids_only])
        return [int(t) for t, _ in steps]

    first = chat(w, HELLO)
    prompt = first["prompt_token_ids"]
    assert first["choices"][0]["token_ids"] == quantized(prompt), "alone"
    again = chat(w, HELLO)
    assert again["choices"][0]["token_ids"] == quantized(prompt) and cached(again) >= 32
    prompts = batch_prompts(tok)
    together = in_parallel(lambda p: complete(w, p), [(p,) for p in prompts])
    assert [b["choices"][0]["token_ids"] for b in together] == [quantized(p) for p in prompts]
    w.stop()


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_rows_past_the_tokenizer_are_never_sampled(family, zoo_root, start_worker):
    """Without the mask, mlx-lm alone picks a row the tokenizer has no id for within a
    few tokens (the zoo's padding rows are weighted to win, as badly initialized ones
    do), and its detokenizer raises IndexError; served, every token is a real one."""
    from mlx_lm.generate import generate_step

    path = build(family, zoo_root)
    model, tok, alone = reference(str(path))
    known = set(tok.get_vocab().values())
    prompt = tok.apply_chat_template(HELLO, add_generation_prompt=True)
    raw = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=64,
                                            sampler=lambda x: mx.argmax(x, axis=-1))]
    assert any(t not in known for t in raw), "the test needs a checkpoint that would"
    w = start(start_worker, path)
    body = chat(w, HELLO, max_tokens=64, logprobs=True, top_logprobs=5)
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == 64 and all(t in known for t in ids)
    assert ids == alone(tuple(body["prompt_token_ids"]), 64)
    with w.client() as c:  # a prompt of token ids the tokenizer lacks: a 400, not a crash
        r = c.post("/v1/completions", json={"model": "m", "prompt": [1, 2, max(known) + 1],
                                            "max_tokens": 2})
    assert r.status_code == 400 and "outside" in r.text
    w.stop()
