"""The bundled SmolLM2-135M-Instruct, end to end through the offline Engine (bf16, the default)."""
from __future__ import annotations

import pytest

from radixserve import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def engine():
    with Engine(check_invariants=True, max_total_tokens=4096) as e:
        yield e


def test_capital_of_france_is_paris(engine):
    out = engine.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}  # <|im_end|>
    assert out["output_ids"][-1] == 2 and "<|im_end|>" not in out["text"]


def test_shared_system_prompt_is_reused(engine):
    system = {"role": "system", "content": "You are a geography tutor. Keep every answer to one short sentence, "
                                           "name the country, and never use lists. " * 3}
    first = engine.chat([system, {"role": "user", "content": "What is the capital of Italy?"}], GREEDY)
    second = engine.chat([system, {"role": "user", "content": "What is the capital of Spain?"}], GREEDY)
    system_len = len(engine.tokenizer.apply_chat_template([system], add_generation_prompt=False))
    assert second["meta_info"]["cached_tokens"] >= system_len
    assert "Rome" in first["text"] and "Spain" in second["text"]


def test_next_chat_turn_reuses_the_previous_answer(engine):
    turn1 = [{"role": "user", "content": "What is the capital of Germany?"}]
    a1 = engine.chat(turn1, GREEDY)
    turn2 = turn1 + [{"role": "assistant", "content": a1["text"]}, {"role": "user", "content": "And of Japan?"}]
    a2 = engine.chat(turn2, GREEDY)
    prompt1 = engine.tokenizer.apply_chat_template(turn1)
    assert a2["meta_info"]["cached_tokens"] >= len(prompt1) + len(a1["output_ids"]) - 2


def test_stop_string_cuts_the_text(engine):
    out = engine.chat([{"role": "user", "content": "What is the capital of France?"}], {**GREEDY, "stop": ["Paris"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "Paris"}
    assert "Paris" not in out["text"] and out["text"].startswith("The capital of France")


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    params = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 16, "seed": 1234}
    alone = engine.generate("Write a haiku about the sea.", params)
    batch = engine.generate(["Tell me a joke.", "Write a haiku about the sea.", "Count to ten."],
                            [{**params, "seed": 7}, params, {"temperature": 0, "max_new_tokens": 5}])
    assert batch[1]["output_ids"] == alone["output_ids"]
    assert batch[1]["text"] == alone["text"]
