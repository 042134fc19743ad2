"""Incremental detokenizing and stop strings, with the real SmolLM2 tokenizer."""
from __future__ import annotations

import pytest

from radixserve.actors.tokenizer import TokenizerCore
from radixserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def core(smollm2_path):
    return TokenizerCore(smollm2_path)


TEXT = "Héllo wörld! 日本語のテキスト 🚀🎉 and code: def f(x):\n    return x**2  # done"


def test_token_by_token_equals_one_decode(core):
    ids = core.encode(TEXT)
    d = core.detokenizer(SamplingParams())
    seen = []
    for t in ids:
        d.add([t])
        seen.append(d.text)
    d.flush()
    assert d.text == core.decode(ids) == TEXT
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), "emitted text never changes afterwards"
    assert all("\ufffd" not in s for s in seen), "no half characters are emitted"


def test_stop_string_straddling_tokens(core):
    ids = core.encode("The answer is forty-two. Goodbye now.")
    d = core.detokenizer(SamplingParams(stop=["two. Good", "never"]))
    stopped = None
    for t in ids:
        stopped = d.add([t])
        if stopped:
            break
    assert stopped == "two. Good" and d.text == "The answer is forty-"


def test_stable_text_holds_back_a_possible_stop(core):
    d = core.detokenizer(SamplingParams(stop="STOP"))
    d.add(core.encode("hello ST"))
    assert d.text.endswith("ST") and d.stable_text == "hello "


def test_chat_template_and_errors(core):
    ids = core.apply_chat_template([{"role": "user", "content": "hi"}])
    assert core.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="non-empty list"):
        core.apply_chat_template([])
