#!/usr/bin/env bash
# Chat, stream and list models with curl against a running `mlxfleet serve`.
set -euo pipefail
URL=${MLXFLEET_URL:-http://127.0.0.1:8000}

curl -s "$URL/v1/models"; echo

curl -s "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "default",
  "messages": [{"role": "user", "content": "What is the capital of Japan?"}],
  "temperature": 0, "max_tokens": 32
}'; echo

# Streaming: server-sent events, one JSON chunk per line, ending with data: [DONE]
curl -sN "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "default", "stream": true,
  "messages": [{"role": "user", "content": "Repeat the word fleet three times."}]
}'
