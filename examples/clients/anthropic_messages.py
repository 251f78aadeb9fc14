"""The anthropic SDK against mlxfleet: messages, streaming and a tool round trip.

Run: python anthropic_messages.py   (with `bash scripts/start.sh` serving the demo model)
"""

import json
import os

import anthropic

client = anthropic.Anthropic(base_url=os.environ.get("MLXFLEET_URL", "http://127.0.0.1:8000"),
                             api_key=os.environ.get("MLXFLEET_API_KEY", "unused"))

msg = client.messages.create(model="default", max_tokens=64, messages=[
    {"role": "user", "content": "What is the capital of Japan?"}])
print(msg.content[0].text)

with client.messages.stream(model="default", max_tokens=64, messages=[
        {"role": "user", "content": "What colour is the sky?"}]) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
print()

weather = {"name": "get_weather", "description": "Get the current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
question = {"role": "user", "content": "What's the weather in Paris?"}
first = client.messages.create(model="default", max_tokens=64, tools=[weather],
                               messages=[question])
use = next(b for b in first.content if b.type == "tool_use")
print("tool call:", use.name, use.input)
result = {"city": use.input.get("city"), "temperature": 21, "condition": "sunny"}
final = client.messages.create(model="default", max_tokens=64, tools=[weather], messages=[
    question, {"role": "assistant", "content": first.content},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                  "content": json.dumps(result)}]}])
print(final.content[0].text)
