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


def feed(core, d, text: str) -> str | None:
    stopped = None
    for t in core.encode(text):
        stopped = d.add([t])
        if stopped:
            break
    return stopped


def test_min_new_tokens_holds_back_stop_strings_and_regexes(core):
    text = "one two one two three"
    n = len(core.encode("one two"))
    assert feed(core, core.detokenizer(SamplingParams(stop="two")), text) == "two"
    late = core.detokenizer(SamplingParams(stop="two", min_new_tokens=n + 1))
    assert feed(core, late, text) == "two" and late.text == "one two one "  # the second one counts
    never = core.detokenizer(SamplingParams(stop="one two", min_new_tokens=len(core.encode(text))))
    assert feed(core, never, text) is None
    never.flush()
    assert never.text == text  # flushing does not find the stops written before min_new_tokens either
    rx = core.detokenizer(SamplingParams(stop_regex=r"t\w+", min_new_tokens=n + 1))
    assert feed(core, rx, text) == r"t\w+" and rx.text == "one two one "


def test_text_replies_for_tokenize_and_detokenize(core):
    from radixserve.wire.messages import TextReq

    ids = core.text_reply(TextReq(1, "tokenize", texts=["Hello", "a b"])).body["tokens"]
    assert ids == [core.encode("Hello"), core.encode("a b")]
    chat = core.text_reply(TextReq(2, "tokenize", messages=[{"role": "user", "content": "hi"}])).body["tokens"]
    assert chat == [core.apply_chat_template([{"role": "user", "content": "hi"}])]
    back = core.text_reply(TextReq(3, "detokenize", token_ids=ids)).body["texts"]
    assert back == ["Hello", "a b"]
    bad = core.text_reply(TextReq(4, "tokenize", messages=[]))
    assert bad.reply_id == 4 and "non-empty" in bad.error and bad.body == {}
