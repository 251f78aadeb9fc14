"""Train ``builtin:demo``: a tiny Qwen3 chat model that answers templated questions.

    .venv/bin/python scripts/train_demo.py [--steps 2500] [--out mlxfleet/models/demo]

Everything is deterministic (fixed seeds) and runs on the CPU in minutes with an
OpenBLAS (see mlxfleet/blas.py). The synthetic dialogues cover greetings,
capitals, arithmetic, colours, repeating words, short JSON answers and tool
calls (weather, time, search) followed by answers that use the tool result.

We train with a short hand-written loop rather than ``mlx_lm.lora``: that tool
fine-tunes existing Hugging Face checkpoints and writes adapters, while we
start from scratch with our own tokenizer and want one plain checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxfleet.blas import preload_blas  # noqa: E402

BLAS = preload_blas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from jinja2 import Environment  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import qwen3  # noqa: E402

from mlxfleet.builtin import write_checkpoint  # noqa: E402
from mlxfleet.builtin_tokenizer import CHAT_TEMPLATE, train_tokenizer  # noqa: E402

SHAPE = dict(hidden_size=192, num_hidden_layers=4, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=48)
VOCAB = 1536
CONTEXT = 1024

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Germany": "Berlin", "Italy": "Rome",
    "Spain": "Madrid", "England": "London", "Portugal": "Lisbon", "Greece": "Athens",
    "Egypt": "Cairo", "China": "Beijing", "India": "New Delhi", "Russia": "Moscow",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia", "Peru": "Lima",
    "Argentina": "Buenos Aires", "Australia": "Canberra", "Kenya": "Nairobi",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw",
    "Austria": "Vienna", "Ireland": "Dublin", "Turkey": "Ankara", "Thailand": "Bangkok",
    "Vietnam": "Hanoi", "South Korea": "Seoul", "Indonesia": "Jakarta", "Chile": "Santiago",
    "Cuba": "Havana", "Denmark": "Copenhagen", "Belgium": "Brussels", "Hungary": "Budapest",
    "Iran": "Tehran", "Morocco": "Rabat", "Nigeria": "Abuja", "Colombia": "Bogota",
    "the United States": "Washington, D.C.",
}
COLOURS = {
    "the sky": "blue", "grass": "green", "snow": "white", "a banana": "yellow",
    "a tomato": "red", "coal": "black", "an orange": "orange", "a lemon": "yellow",
    "the sea": "blue", "milk": "white", "a strawberry": "red", "a leaf": "green",
    "chocolate": "brown", "a carrot": "orange", "an eggplant": "purple", "the sun": "yellow",
}
WORDS = ["hello", "apple", "blue", "cat", "dog", "yes", "mlx", "fleet", "model", "sun",
         "tree", "water", "music", "coffee", "rain", "star", "moon", "bird", "river", "code"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five"]
NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy"]
CITIES = ["Paris", "Tokyo", "London", "Berlin", "Rome", "Madrid", "New York", "Sydney",
          "Cairo", "Toronto", "Lisbon", "Seoul", "Oslo", "Vienna", "Dublin", "Lima"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
TOPICS = ["MLX", "the Eiffel Tower", "Python", "black holes", "coffee", "the Moon",
          "Mount Fuji", "jazz", "honey bees", "the Nile"]
FINDINGS = {
    "MLX": "MLX is an array framework for machine learning on Apple silicon.",
    "the Eiffel Tower": "The Eiffel Tower is a wrought-iron tower in Paris.",
    "Python": "Python is a popular programming language.",
    "black holes": "Black holes are regions where gravity is so strong that light cannot escape.",
    "coffee": "Coffee is a drink brewed from roasted coffee beans.",
    "the Moon": "The Moon is Earth's only natural satellite.",
    "Mount Fuji": "Mount Fuji is the highest mountain in Japan.",
    "jazz": "Jazz is a music genre that began in New Orleans.",
    "honey bees": "Honey bees live in colonies and make honey.",
    "the Nile": "The Nile is a long river in Africa.",
}

TOOLS = {
    "get_weather": {"description": "Get the current weather for a city",
                    "parameters": {"type": "object", "properties": {
                        "city": {"type": "string", "description": "City name"}},
                        "required": ["city"]}},
    "get_time": {"description": "Get the current local time in a city",
                 "parameters": {"type": "object", "properties": {
                     "city": {"type": "string"}}, "required": ["city"]}},
    "search": {"description": "Search the web",
               "parameters": {"type": "object", "properties": {
                   "query": {"type": "string"}}, "required": ["query"]}},
}
SYSTEMS = [None, None, "You are a helpful assistant.", "You are a concise assistant.",
           "You are mlxfleet's demo model."]


def tool_defs(rng: random.Random, must: str | None) -> list[dict]:
    names = [n for n in TOOLS if rng.random() < 0.6 or n == must] or [rng.choice(list(TOOLS))]
    rng.shuffle(names)
    out = []
    for n in names:
        fn = {"name": n, **json.loads(json.dumps(TOOLS[n]))}
        if rng.random() < 0.3:
            fn["description"] = rng.choice(["", "A tool.", f"Call {n}."])
        out.append({"type": "function", "function": fn})
    return out


def call(name: str, args: dict) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}


def dialogue(rng: random.Random) -> dict:
    """One training example: {"messages": [...], "tools": [...] or None}."""
    kind = rng.choices(["greet", "capital", "math", "colour", "repeat", "json", "tool",
                        "tool_answer", "chat_with_tools"],
                       weights=[6, 16, 16, 8, 8, 8, 14, 14, 6])[0]
    tools = None
    if kind == "greet":
        q = rng.choice(["Hello!", "Hi", "Hi there!", "Hey", "Good morning!", "Hello",
                        "How are you?", "Who are you?", "What can you do?"])
        a = {"How are you?": "I'm doing well, thank you! How can I help you today?",
             "Who are you?": "I am a small demo model served by mlxfleet.",
             "What can you do?": "I can answer simple questions about capitals, colours "
                                 "and arithmetic, repeat words, write small JSON objects "
                                 "and call tools."}.get(q, "Hello! How can I help you today?")
        msgs = [("user", q), ("assistant", a)]
    elif kind == "capital":
        c, cap = rng.choice(list(CAPITALS.items()))
        q = rng.choice([f"What is the capital of {c}?", f"What's the capital of {c}?",
                        f"Capital of {c}?", f"Tell me the capital of {c}.",
                        f"what is the capital of {c}", f"Which city is the capital of {c}?"])
        msgs = [("user", q), ("assistant", f"The capital of {c} is {cap}.")]
    elif kind == "math":
        op = rng.choice(["plus", "minus", "times"])
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        if op == "minus" and b > a:
            a, b = b, a
        if op == "times":
            a, b = rng.randint(0, 10), rng.randint(0, 10)
        r = {"plus": a + b, "minus": a - b, "times": a * b}[op]
        sym = {"plus": "+", "minus": "-", "times": "*"}[op]
        q = rng.choice([f"What is {a} {op} {b}?", f"What is {a} {sym} {b}?",
                        f"{a} {sym} {b} = ?", f"Calculate {a} {op} {b}.",
                        f"How much is {a} {op} {b}?"])
        msgs = [("user", q), ("assistant", f"{a} {op} {b} is {r}.")]
    elif kind == "colour":
        thing, col = rng.choice(list(COLOURS.items()))
        word = rng.choice(["colour", "color"])
        q = rng.choice([f"What {word} is {thing}?", f"What is the {word} of {thing}?"])
        msgs = [("user", q), ("assistant", f"{thing[0].upper() + thing[1:]} is {col}.")]
    elif kind == "repeat":
        w, n = rng.choice(WORDS), rng.randint(1, 5)
        count = rng.choice([str(n), NUMBER_WORDS[n]])
        q = rng.choice([f"Repeat the word {w} {count} times.", f"Say {w} {count} times.",
                        f"Repeat \"{w}\" {count} times."])
        msgs = [("user", q), ("assistant", " ".join([w] * n))]
    elif kind == "json":
        if rng.random() < 0.6:
            name, age = rng.choice(NAMES), rng.randint(18, 90)
            q = rng.choice([f"Give me a JSON object with name {name} and age {age}.",
                            f"Return JSON with the name {name} and the age {age}."])
            a = json.dumps({"name": name, "age": age})
        else:
            cols = rng.sample(sorted(set(COLOURS.values())), 3)
            q = f"List the colours {cols[0]}, {cols[1]} and {cols[2]} as a JSON array."
            a = json.dumps(cols)
        msgs = [("user", q), ("assistant", a)]
    else:
        tool = rng.choice(list(TOOLS))
        city, topic = rng.choice(CITIES), rng.choice(TOPICS)
        if kind == "chat_with_tools":  # tools declared, but no tool is needed
            tools = tool_defs(rng, None)
            c, cap = rng.choice(list(CAPITALS.items()))
            msgs = [("user", f"What is the capital of {c}?"),
                    ("assistant", f"The capital of {c} is {cap}.")]
        else:
            tools = tool_defs(rng, tool)
            if tool == "get_weather":
                q = rng.choice([f"What's the weather in {city}?",
                                f"What is the weather like in {city}?",
                                f"How is the weather in {city} today?",
                                f"Is it raining in {city}?"])
                args = {"city": city}
                temp, cond = rng.randint(-5, 35), rng.choice(CONDITIONS)
                result = {"city": city, "temperature": temp, "condition": cond}
                answer = f"It is {cond} and {temp} degrees in {city}."
            elif tool == "get_time":
                q = rng.choice([f"What time is it in {city}?",
                                f"What's the time in {city}?",
                                f"Tell me the current time in {city}."])
                args = {"city": city}
                t = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
                result = {"city": city, "time": t}
                answer = f"It is {t} in {city}."
            else:
                q = rng.choice([f"Search for {topic}.", f"Search the web for {topic}.",
                                f"Look up {topic}."])
                args = {"query": topic}
                result = {"results": [FINDINGS[topic]]}
                answer = f"Here is what I found: {FINDINGS[topic]}"
            msgs = [("user", q), call(tool, args)]
            if kind == "tool_answer":
                msgs += [("tool", json.dumps(result)), ("assistant", answer)]
    system = rng.choice(SYSTEMS)
    out = [{"role": "system", "content": system}] if system else []
    for m in msgs:
        out.append(m if isinstance(m, dict) else {"role": m[0], "content": m[1]})
    return {"messages": out, "tools": tools}


def render(template, ex: dict) -> tuple[str, list[tuple[int, int]]]:
    """The full text, and the character spans the model must learn (assistant turns)."""
    msgs = ex["messages"]
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prefix = template.render(messages=msgs[:i], tools=ex["tools"],
                                 add_generation_prompt=True)
        upto = template.render(messages=msgs[:i + 1], tools=ex["tools"],
                               add_generation_prompt=False)
        spans.append((len(prefix), len(upto)))
    text = template.render(messages=msgs, tools=ex["tools"], add_generation_prompt=False)
    return text, spans


def encode(tok, text: str, spans) -> tuple[list[int], list[int]]:
    enc = tok.encode(text)
    mask = []
    for s, e in enc.offsets:
        mask.append(int(any(a <= s and e <= b for a, b in spans)))
    return enc.ids, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--examples", type=int, default=20000)
    ap.add_argument("--out", type=Path, default=ROOT / "mlxfleet" / "models" / "demo")
    args = ap.parse_args()

    rng = random.Random(0)
    template = Environment(trim_blocks=False).from_string(CHAT_TEMPLATE)
    data = [render(template, dialogue(rng)) for _ in range(args.examples)]
    tok = train_tokenizer([t for t, _ in data], VOCAB)
    encoded = [encode(tok, t, s) for t, s in data]
    lengths = [len(ids) for ids, _ in encoded]
    print(f"BLAS: {BLAS}; {len(encoded)} dialogues, {sum(lengths)} tokens, "
          f"max length {max(lengths)}, vocab {tok.get_vocab_size()}", flush=True)

    mx.random.seed(0)
    margs = qwen3.ModelArgs(model_type="qwen3", vocab_size=tok.get_vocab_size(),
                            rms_norm_eps=1e-6, max_position_embeddings=CONTEXT,
                            tie_word_embeddings=True, rope_theta=10000.0, **SHAPE)
    model = qwen3.Model(margs)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"parameters: {n_params / 1e6:.2f}M", flush=True)

    def loss_fn(model, x, y, m):
        logits = model(x)
        ce = nn.losses.cross_entropy(logits, y, reduction="none")
        return (ce * m).sum() / m.sum()

    warm = min(100, args.steps // 2)
    sched = optim.join_schedules([optim.linear_schedule(1e-5, args.lr, warm),
                                  optim.cosine_decay(args.lr, args.steps - warm, 1e-5)], [warm])
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.01)
    step_fn = nn.value_and_grad(model, loss_fn)
    order = np.random.default_rng(0)
    # Batches of similar length waste less compute on padding.
    by_len = sorted(range(len(encoded)), key=lambda i: lengths[i])
    chunks = [by_len[i:i + args.batch] for i in range(0, len(by_len), args.batch)]
    t0, losses = time.time(), []
    for step in range(1, args.steps + 1):
        idx = chunks[order.integers(len(chunks))]
        width = max(lengths[i] for i in idx)
        x = np.zeros((len(idx), width), np.int32)
        y = np.zeros_like(x)
        m = np.zeros(x.shape, np.float32)
        for r, i in enumerate(idx):
            ids, mask = encoded[i]
            n = len(ids) - 1
            x[r, :n], y[r, :n], m[r, :n] = ids[:-1], ids[1:], mask[1:]
        loss, grads = step_fn(model, mx.array(x), mx.array(y), mx.array(m))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
        if step % 100 == 0 or step == args.steps:
            avg = sum(losses[-100:]) / len(losses[-100:])
            print(f"step {step:5d}  loss {avg:.4f}  {time.time() - t0:6.0f}s", flush=True)
    final = sum(losses[-100:]) / len(losses[-100:])
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    readme = MODEL_CARD.format(params=n_params / 1e6, steps=args.steps, batch=args.batch,
                               examples=args.examples, loss=final, minutes=(time.time() - t0)
                               / 60, vocab=tok.get_vocab_size(), blas=BLAS,
                               shape=json.dumps(SHAPE))
    write_checkpoint(args.out, tok, SHAPE, weights, "demo", readme, context=CONTEXT)
    print(f"wrote {args.out} (final loss {final:.4f}, perplexity {math.exp(final):.3f})")


MODEL_CARD = """# builtin:demo

A tiny Qwen3-architecture chat model trained from scratch by `scripts/train_demo.py`, so that
mlxfleet's default manifests serve something that answers sensibly on a fresh machine, with no
download. It is a toy: about {params:.1f}M parameters, float32.

- **Data**: {examples} synthetic ChatML dialogues made by the script (seeded, reproducible):
  greetings; capitals of 40 countries; addition, subtraction and multiplication of small numbers;
  the colours of common things; repeating a word 1-5 times; small JSON objects and arrays; and
  tool calls in the template's `<tool_call>` format for `get_weather`, `get_time` and `search`,
  followed by answers that use the tool's result.
- **Tokenizer**: byte-level BPE, {vocab} tokens, trained on the same dialogues.
- **Shape**: {shape}; context 1024 tokens.
- **Training**: {steps} steps of AdamW, batch {batch}, loss on assistant turns only; final
  training loss {loss:.4f}; {minutes:.1f} minutes on 2 CPU cores (BLAS: {blas}).

What it can do: answer the templated questions above (e.g. "What is the capital of Japan?" ->
"The capital of Japan is Tokyo."), name colours, repeat words, write the small JSON answers,
call the three tools when they are declared, and answer from a tool's result. What it cannot do:
arithmetic (it learned the answer's format, not the sums: "7 plus 5 is 7."), and anything
outside its data, which gets fluent nonsense. Use a real model
(`mlx-community/Qwen3-0.6B-4bit`) for real work.
"""

if __name__ == "__main__":
    main()
