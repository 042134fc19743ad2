#!/usr/bin/env bash
# Simulator and live server side by side on the same traces (the figures in the policy-lab closing note):
#   1. shared-prefix groups, a cache too small for all groups: LPM vs FCFS
#   2. a skewed few-shot workload with one-off long prompts: LFU / GDSF vs LRU
# Starts its own server (bundled SmolLM2, 1536-token pool, 4 running requests). About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-30200}
URL=http://127.0.0.1:$PORT
$PY -m radixserve serve --port "$PORT" --max-total-tokens 1536 --max-running-requests 4 > /tmp/compare-server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER; wait $SERVER' EXIT
for _ in $(seq 1 120); do curl -sf "$URL/health" > /dev/null && break; sleep 1; done
$PY -m radixserve compare --workload shared-prefix --requests 60 --groups 6 --prefix-tokens 256 \
  --suffix-tokens 16 --output-tokens 8 --rate 2 --eviction lru --schedule fcfs,lpm --live "$URL" --simulate \
  --calibrate "$URL" --max-running 4 --cache-sizes 512,1024,1536,3072 --out benchmarks/results/compare-shared-prefix
$PY -m radixserve compare --workload few-shot --requests 100 --groups 8 --prefix-tokens 256 \
  --suffix-tokens 16 --output-tokens 8 --rate 1 --noise 0.5 --skew 1.2 --eviction lru,lfu,gdsf --schedule fcfs \
  --live "$URL" --simulate --calibrate "$URL" --max-running 4 --cache-sizes 768,1536,3072 \
  --out benchmarks/results/compare-few-shot
