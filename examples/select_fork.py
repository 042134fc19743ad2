"""select and fork: choices scored on one cached prompt, three continuations sharing one prefix.

    make serve
    python examples/select_fork.py
"""
from __future__ import annotations

import argparse

import radixserve.lang as sgl
from radixserve.lang import RuntimeEndpoint


@sgl.function
def trip(s, city):
    s += sgl.system("You are a travel guide. Answer briefly.")
    s += sgl.user(f"Which country is {city} in?")
    s += sgl.assistant(sgl.select("country", choices=["France", "Germany", "Japan", "Brazil"]))
    s += sgl.user(f"Give one tip for a visitor to {city}.")
    tips = s.fork(3)  # the conversation so far is prefilled once; the three tips reuse its KV
    tips += sgl.assistant(sgl.gen("tip", max_tokens=32, temperature=0.8, stop="\n"))
    tips.join()


def main(backend) -> dict:
    state = trip.run(city="Paris", backend=backend)
    return {"country": state["country"], "tips": state["tip"],
            "normalized_logprobs": state.get_meta_info("country")["normalized_prompt_logprobs"]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://localhost:30000")
    result = main(RuntimeEndpoint(parser.parse_args().url))
    print("country:", result["country"])
    for tip in result["tips"]:
        print("tip:", tip.strip())
