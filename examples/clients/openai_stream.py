"""Stream tokens as they are generated. Run: python openai_stream.py"""

import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("MLXFLEET_URL", "http://127.0.0.1:8000") + "/v1",
                api_key=os.environ.get("MLXFLEET_API_KEY", "unused"))

stream = client.chat.completions.create(
    model="default", stream=True, stream_options={"include_usage": True},
    messages=[{"role": "user", "content": "Hello! What can you do?"}])
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    elif chunk.usage:
        print(f"\n[{chunk.usage.completion_tokens} tokens]")
