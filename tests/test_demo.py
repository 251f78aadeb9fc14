"""The bundled demo model answers sensibly, served through the gateway."""

from __future__ import annotations

import json

import pytest
from served import Served, manifest

from mlxfleet.builtin import demo_dir

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    f = Served(tmp_path_factory.mktemp("demo"))
    f.write("demo.yaml", manifest("demo", source="builtin:demo", aliases=["default"]))
    f.start()
    f.wait_ready("demo")
    yield f
    f.stop()


def ask(served, question: str, **kw):
    return served.openai().chat.completions.create(
        model="default", messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=60, **kw)


def test_demo_is_small_and_documented():
    size = sum(f.stat().st_size for f in demo_dir().iterdir())
    assert size < 10 << 20
    card = (demo_dir() / "README.md").read_text()
    assert "scripts/train_demo.py" in card and "cannot" in card


@pytest.mark.parametrize("question,answer", [
    ("What is the capital of Japan?", "Tokyo"),
    ("What's the capital of France?", "Paris"),
    ("What colour is the sky?", "blue"),
    ("Repeat the word fleet three times.", "fleet fleet fleet"),
])
def test_demo_answers_templated_questions(served, question, answer):
    r = ask(served, question)
    assert answer in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # it ends its turn by itself


def test_demo_writes_json(served):
    r = ask(served, "Give me a JSON object with name Alice and age 30.")
    assert json.loads(r.choices[0].message.content) == {"name": "Alice", "age": 30}


def test_demo_calls_a_declared_tool_and_uses_the_result(served):
    r = ask(served, "What's the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="auto")
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert not msg.content  # no markup leaks into the content
    (call,) = msg.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The round trip: the tool's result goes back, the model answers from it.
    r2 = served.openai().chat.completions.create(
        model="default", temperature=0, max_tokens=60, tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "What's the weather in Paris?"},
                  msg.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id,
                   "content": json.dumps({"city": "Paris", "temperature": 18,
                                          "condition": "rainy"})}])
    answer = r2.choices[0].message.content
    assert "rainy" in answer and "18" in answer, answer


def test_demo_streams_a_tool_call_in_openai_delta_format(served):
    chunks = list(served.openai().chat.completions.create(
        model="default", temperature=0, max_tokens=60, tools=[WEATHER_TOOL], stream=True,
        messages=[{"role": "user", "content": "What's the weather in Paris?"}]))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert "<tool_call>" not in content and "get_weather" not in content
    assert deltas and deltas[0].index == 0 and deltas[0].id and \
        deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_ignore_eos_generates_exactly_max_tokens(served):
    short = ask(served, "What is the capital of Japan?")
    assert short.usage.completion_tokens < 60
    long = ask(served, "What is the capital of Japan?", extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 60 and long.choices[0].finish_reason == "length"
