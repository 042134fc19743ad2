"""JSON extraction: the output is forced to follow a JSON schema (constrained decoding), for a batch of texts.

    make serve
    python examples/json_extraction.py
"""
from __future__ import annotations

import argparse
import json

import radixserve.lang as sgl
from radixserve.lang import RuntimeEndpoint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

TEXTS = [
    "Maria Lopez, 34, moved to Madrid last year.",
    "Born in 1990, Tom Baker (now 35) lives in Leeds.",
    "Our new colleague Aiko Tanaka is 28 and comes from Osaka.",
]


@sgl.function
def extract(s, text):
    s += sgl.system("Extract the person described in the text as JSON with keys name, age and city.")
    s += sgl.user(text)
    s += sgl.assistant(sgl.gen("person", max_tokens=96, json_schema=PERSON))


def main(backend) -> dict:
    # one batch: the shared system prompt is prefilled once, then the three run concurrently
    states = extract.run_batch([{"text": t} for t in TEXTS], backend=backend, temperature=0)
    return {"people": [json.loads(s["person"]) for s in states],
            "cached_tokens": [s.get_meta_info("person")["cached_tokens"] for s in states]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://localhost:30000")
    result = main(RuntimeEndpoint(parser.parse_args().url))
    for person in result["people"]:
        print(json.dumps(person))
    print("prompt tokens reused from the cache per request:", result["cached_tokens"])
