#!/usr/bin/env bash
# Issue 41's measurements on one server, nothing else running (docs/performance-journal.md, "The
# live page's cost"): W1 served with nothing, /health or /dashboard/state polled at 10 Hz,
# alternated; then the served load through chat and through the Responses API. Prefix caching is
# off: every run sends the same seeded prompts. Results: one JSON per run in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvflow-page-and-routes}; mkdir -p "$OUT"
PORT=${PORT:-8131}; URL=http://127.0.0.1:$PORT
.venv/bin/kvflow serve --port "$PORT" --disable-log-stats --uvicorn-log-level warning --no-enable-prefix-caching \
    > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
until grep -q "ready" "$OUT/server.log"; do sleep 0.5; done
W1="--num-prompts 128 --input-len 272 --input-dist uniform:0.88 --output-len 128 --request-rate inf --json"
SERVED="--num-prompts 64 --input-len 256 --input-dist fixed --output-len 64 --concurrency 16 --json"
.venv/bin/kvflow bench serve --url "$URL" --num-prompts 16 --input-len 128 --output-len 16 --concurrency 8 > /dev/null
i=0
for mode in none dash health dash none health none dash; do
  i=$((i+1))
  case $mode in health) P=/health;; dash) P=/dashboard/state;; *) P="";; esac
  if [ -n "$P" ]; then .venv/bin/python benchmarks/poll_path.py "$URL" 10 "$P" > "$OUT/poll_${mode}_$i.log" & POLL=$!; fi
  .venv/bin/kvflow bench serve --url "$URL" $W1 > "$OUT/w1_${mode}_$i.json"
  if [ -n "$P" ]; then kill -TERM $POLL; wait $POLL; fi
done
for round in 1 2; do
  .venv/bin/kvflow bench serve --url "$URL" --backend openai-chat $SERVED > "$OUT/served_chat_$round.json"
  .venv/bin/kvflow bench serve --url "$URL" --backend openai-responses $SERVED > "$OUT/served_responses_$round.json"
done
