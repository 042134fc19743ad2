"""The script the RadixAttention article runs with SGLang's frontend, with only its import lines changed.

    make serve                        # in one terminal (http://localhost:30000)
    python examples/article_qa.py     # in another
"""
from __future__ import annotations

import argparse

import radixserve.lang as sgl
from radixserve.lang import RuntimeEndpoint

q = "What is the capital of France?"


@sgl.function
def qa(s):
    s += sgl.user(q)
    s += sgl.assistant(sgl.gen("answer", max_tokens=64))


def main(backend, temperature: float = 0.1) -> dict:
    state = qa.run(backend=backend, temperature=temperature, top_p=0.95)
    again = qa.run(backend=backend, temperature=temperature, top_p=0.95)  # the same prompt: its KV comes from the cache
    return {
        "answer": state["answer"],
        "prompt_tokens": again.get_meta_info("answer")["prompt_tokens"],
        "cached_tokens_second_run": again.get_meta_info("answer")["cached_tokens"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://localhost:30000")
    result = main(RuntimeEndpoint(parser.parse_args().url))
    print(result["answer"])
    print(f"second run: {result['cached_tokens_second_run']} of {result['prompt_tokens']} prompt tokens "
          "came from the radix cache")
