"""Drives a radixserve server with SGLang's own frontend (the ``sglang`` package from PyPI, unchanged) and prints
what it got as JSON. Run with the frontend on the path: ``PYTHONPATH=.venv/sglang-frontend python drive.py URL``
(``make install`` puts it there). tests/test_sglang_frontend.py checks the output."""
from __future__ import annotations

import json
import sys

import sglang as sgl
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}}, "required": ["name"],
          "additionalProperties": False}


@sgl.function
def qa(s, q):
    s += sgl.user(q)
    s += sgl.assistant(sgl.gen("answer", max_tokens=64))


@sgl.function
def pick(s):
    s += "The capital of France is"
    s += sgl.select("city", choices=[" Paris", " London", " Berlin"])


@sgl.function
def facts(s):
    s += "Here are three facts about the Moon, one per line. Fact:"
    forks = s.fork(3)
    forks += sgl.gen("fact", max_tokens=16, temperature=0.8, stop="\n")
    forks.join()


@sgl.function
def short(s, q):
    s += sgl.system("You are a concise assistant. You answer every question with a single word, nothing more.")
    s += sgl.user(q)
    s += sgl.assistant(sgl.gen("a", max_tokens=12))


@sgl.function
def person(s):
    s += sgl.user("Give a person as JSON.")
    s += sgl.assistant(sgl.gen("j", max_tokens=64, json_schema=json.dumps(PERSON)))


@sgl.function
def year(s):
    s += "The year the Eiffel Tower was built: "
    s += sgl.gen("y", max_tokens=8, regex=r"1[0-9]{3}")
    s += " and an integer: " + sgl.gen("n", dtype=int, max_tokens=8)


def main(url: str) -> dict:
    backend = RuntimeEndpoint(url)
    sgl.set_default_backend(backend)  # sglang 0.5.23's run_batch traces with the default backend
    out = {"model_path": backend.get_model_name()}
    state = qa.run(q="What is the capital of France?", backend=backend, temperature=0.1, top_p=0.95)
    out["answer"] = state["answer"]
    out["select"] = pick.run(backend=backend)["city"]
    out["facts"] = facts.run(backend=backend)["fact"]
    batch = short.run_batch([{"q": "Name a color."}, {"q": "Name a fruit."}], temperature=0)
    out["batch"] = [s["a"] for s in batch]
    out["batch_cached"] = [s.get_meta_info("a")["cached_tokens"] for s in batch]
    out["json"], out["json_schema"] = person.run(backend=backend, temperature=0)["j"], PERSON
    state = year.run(backend=backend, temperature=0)
    out["year"], out["integer"] = state["y"], state["n"]
    streamed = qa.run(q="What is the capital of France?", backend=backend, stream=True, temperature=0)
    out["stream_pieces"] = list(streamed.text_iter("answer"))
    out["stream_answer"] = streamed["answer"]
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
