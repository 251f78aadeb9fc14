"""The bundled demo model answers sensibly, served through the gateway."""

from __future__ import annotations

import json

import pytest
from fleet import Fleet, manifest

from mlxfleet.worker.builtin import demo_dir

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("demo"))
    f.write("demo.yaml", manifest("demo", source="builtin:demo", aliases=["default"]))
    f.start()
    f.wait_ready("demo")
    yield f
    f.stop()


def ask(fleet, question: str, **kw):
    return fleet.openai().chat.completions.create(
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
def test_demo_answers_templated_questions(fleet, question, answer):
    r = ask(fleet, question)
    assert answer in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # it ends its turn by itself


def test_demo_writes_json(fleet):
    r = ask(fleet, "Give me a JSON object with name Alice and age 30.")
    assert json.loads(r.choices[0].message.content) == {"name": "Alice", "age": 30}


def test_demo_calls_a_declared_tool(fleet):
    r = ask(fleet, "What's the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="auto")
    text = r.choices[0].message.content
    assert "<tool_call>" in text
    call = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])
    assert call == {"name": "get_weather", "arguments": {"city": "Paris"}}


def test_ignore_eos_generates_exactly_max_tokens(fleet):
    short = ask(fleet, "What is the capital of Japan?")
    assert short.usage.completion_tokens < 60
    long = ask(fleet, "What is the capital of Japan?", extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 60 and long.choices[0].finish_reason == "length"
