"""Record the HTTP API reference's examples: start `radixserve serve` with the bundled model, send one request to
every route, and write each request with the answer it got to docs/api-examples.json (long values cut). The docs
build (docs/hooks.py) shows them, and warns (fails, under --strict) for a route that has none.

    python docs/record_examples.py          (a minute or two; rerun after changing what a route answers)
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tqdm import tqdm

from radixserve.server_process import ServerProcess

OUT = Path(__file__).with_name("api-examples.json")
ROOT = OUT.parents[1]
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
        "temperature": 0}
# (route as the app names it, url, body): in order; "{response_id}" is the one the POST /v1/responses answered
EXAMPLES = [
    ("GET /v1/models", "/v1/models", None),
    ("GET /v1/models/{model}", "/v1/models/default", None),
    ("POST /v1/chat/completions", "/v1/chat/completions", CHAT),
    ("POST /v1/completions", "/v1/completions", {"model": "default", "prompt": "The sky is", "max_tokens": 6,
                                                 "temperature": 0}),
    ("POST /tokenize", "/tokenize", {"model": "default", "prompt": "Hello world"}),
    ("POST /detokenize", "/detokenize", {"model": "default", "tokens": [19556, 905]}),
    ("POST /v1/tokenize", "/v1/tokenize", {"model": "default", "prompt": "Hello world"}),
    ("POST /v1/detokenize", "/v1/detokenize", {"model": "default", "tokens": [19556, 905]}),
    ("POST /v1/responses", "/v1/responses", {"model": "default", "input": "Name a colour.", "max_output_tokens": 8,
                                             "temperature": 0, "store": True}),
    ("GET /v1/responses/{response_id}", "/v1/responses/{response_id}", None),
    ("DELETE /v1/responses/{response_id}", "/v1/responses/{response_id}", None),
    ("POST /generate", "/generate", {"text": "The capital of France is",
                                     "sampling_params": {"max_new_tokens": 6, "temperature": 0}}),
    ("POST /abort_request", "/abort_request", {"rid": "no-such-request"}),
    ("POST /flush_cache", "/flush_cache", {}),
    ("GET /policies", "/policies", None),
    ("POST /policies", "/policies", {"eviction": "lfu", "schedule": "lpm"}),
    ("GET /policies/shadow", "/policies/shadow", None),
    ("GET /cache/stats", "/cache/stats", None),
    ("GET /get_server_info", "/get_server_info", None),
    ("GET /server_info", "/server_info", None),
    ("GET /get_model_info", "/get_model_info", None),
    ("GET /model_info", "/model_info", None),
    ("GET /health", "/health", None),
    ("GET /health_generate", "/health_generate", None),
    ("GET /metrics", "/metrics", None),
    ("GET /dashboard", "/dashboard", None),
    ("GET /dashboard/state", "/dashboard/state", None),
    ("GET /dashboard/{file}", "/dashboard/dashboard.css", None),
]


def cut(value, depth: int = 0):
    """The answer as shown: lists past 4 items and strings past 240 characters cut, and nesting past 4 levels."""
    if isinstance(value, dict):
        if depth >= 4:
            return "..." if value else {}
        keys = list(value)
        out = {k: cut(value[k], depth + 1) for k in keys[:24]}
        if len(keys) > 24:
            out["..."] = f"{len(keys) - 24} more keys"
        return out
    if isinstance(value, list):
        out = [cut(v, depth + 1) for v in value[:4]]
        return out + [f"... {len(value) - 4} more"] if len(value) > 4 else out
    if isinstance(value, str):
        value = value.replace(str(ROOT), "<checkout>")  # where this machine keeps things says nothing
        return value[:240] + " ..." if len(value) > 240 else value
    return value


def send(base: str, url: str, method: str, body) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, raw, kind = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        status, raw, kind = exc.code, exc.read(), exc.headers.get("Content-Type", "")
    if "json" in kind:
        return status, cut(json.loads(raw))
    text = raw.decode(errors="replace")
    lines = text.splitlines()
    return status, "\n".join(lines[:12]) + (f"\n... ({len(lines) - 12} more lines)" if len(lines) > 12 else "")


def main() -> int:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=OUT.parent).stdout.strip()
    server = ServerProcess("--served-model-name", "default", "--shadow-policies", "lfu:lpm,lru:fcfs",
                           "--num-threads", "2")
    recorded, response_id = {}, None
    try:
        for name, url, body in tqdm(EXAMPLES, desc="routes"):
            method = name.split()[0]
            url = url.replace("{response_id}", str(response_id))
            status, answer = send(server.url, url, method, body)
            if name == "POST /v1/responses":
                response_id = answer.get("id") if isinstance(answer, dict) else None
            recorded[name] = {"url": url, "body": body, "status": status, "answer": answer}
            time.sleep(0.05)
    finally:
        server.stop()
    OUT.write_text(json.dumps({"commit": commit, "recorded": time.strftime("%Y-%m-%d"), "routes": recorded},
                              indent=1) + "\n")
    print(f"wrote {OUT} ({len(recorded)} routes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
