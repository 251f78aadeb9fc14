"""Chat with the openai SDK: only the base URL changes. Run: python openai_chat.py"""

import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("MLXFLEET_URL", "http://127.0.0.1:8000") + "/v1",
                api_key=os.environ.get("MLXFLEET_API_KEY", "unused"))

for question in ["What is the capital of Japan?", "What is 7 plus 5?",
                 "Give me a JSON object with name Alice and age 30."]:
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": question}], temperature=0)
    print(f"{question}\n  -> {reply.choices[0].message.content}")
