"""stop_regex on RE2: the earliest-match cut of Python's ``re`` (on RE2's syntax), in linear time, looking only where a
new match can end; a request whose matching outruns its CPU budget fails alone; a pattern RE2 cannot run is a 400."""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams
from radixserve.stop_regex import WINDOW, StopRegexes

ASCII_PATTERNS = [
    ["ab"], ["a+b"], ["b|ab"], ["x.*y"], ["a*"], ["(?:ab)+c"], ["^a"], ["(?m)^b"], ["a$"], ["c\\b"], ["\\bab"],
    ["a\\B"], ["[^a]{3}"], ["(?:a|b)*c"], ["(?i)AB"], ["\\d+\\."], ["\\s\\s"], ["a{2,3}b?"], ["(?s)a.b"], ["y(?:x|)"],
    ["cd", "bcd", "abcd"], ["ab", "a+b"], ["b", "a"], ["x.*y", "\\n"],
]
UNICODE_PATTERNS = [["é+"], ["a.é"], ["日本?"], ["(?s)é.*日", "b"]]


def reference(patterns: list[str], steps: list[str], floor_steps: int) -> tuple[int, int, str] | None:
    """What the tokenizer did with Python's ``re``: after each step, the earliest match over the whole text from
    the floor (the text of the first ``floor_steps`` steps). ``$`` is RE2's: the end of the text (``\\Z``)."""
    compiled = [(re.compile(p.replace("$", "\\Z")), p) for p in patterns]
    text = "".join(steps[:floor_steps])
    floor = len(text)
    for k in range(floor_steps, len(steps)):
        text += steps[k]
        hits = [(m.start(), p) for r, p in compiled if (m := r.search(text, floor))]
        if hits:
            return (k, *min(hits))
    return None


def streamed(patterns: list[str], steps: list[str], floor_steps: int) -> tuple[int, int, str] | None:
    matcher = StopRegexes(patterns)
    text = "".join(steps[:floor_steps])
    floor = len(text)
    for k in range(floor_steps, len(steps)):
        text += steps[k]
        if (hit := matcher.search(text, floor)) is not None:
            return (k, *hit)
    return None


def chunked(alphabet: str):
    """Steps of 0-8 characters (a token's text, or none while a character is incomplete), and how many come before
    the floor."""
    steps = st.lists(st.text(alphabet, max_size=8), min_size=1, max_size=12)
    return st.tuples(steps, st.integers(0, 3))


@pytest.mark.parametrize("patterns", ASCII_PATTERNS, ids=[" | ".join(p) for p in ASCII_PATTERNS])
@settings(max_examples=150, deadline=None)
@given(case=chunked("abcdxy1. \n"))
def test_the_cut_is_python_re_earliest_match(patterns, case):
    """Same step, same cut, same pattern as Python's re searching the whole text each step: matches straddling
    steps, patterns that match the empty string (at the floor, at once), anchors and word boundaries at the end
    of a step (they see what came since), and the first pattern by name on a tie."""
    steps, floor_steps = case
    floor_steps = min(floor_steps, len(steps) - 1)
    assert streamed(patterns, steps, floor_steps) == reference(patterns, steps, floor_steps)


@pytest.mark.parametrize("patterns", UNICODE_PATTERNS, ids=[" | ".join(p) for p in UNICODE_PATTERNS])
@settings(max_examples=100, deadline=None)
@given(case=chunked("aébü日本 "))
def test_the_cut_is_in_characters_not_bytes(patterns, case):
    steps, floor_steps = case
    floor_steps = min(floor_steps, len(steps) - 1)
    assert streamed(patterns, steps, floor_steps) == reference(patterns, steps, floor_steps)


def test_a_long_addition_is_checked_in_pieces():
    """A step that adds more than the window is checked a window at a time, as if it had come in several tokens:
    a match in the middle or across a piece's edge is still found, where Python's re finds it."""
    for at in (0, 5, WINDOW - 1, WINDOW, 150, 3 * WINDOW - 1):
        text = "x" * at + "ab" + "x" * 200
        assert StopRegexes(["ab"]).search(text, 0) == (at, "ab") == (re.search("ab", text).start(), "ab")
    matcher = StopRegexes(["a.*b"])
    assert matcher.search("a" + "x" * 500, 0) is None
    assert matcher.search("a" + "x" * 500 + "b", 0) == (0, "a.*b")  # the start lies far before the window


CATASTROPHIC = [r"(a+)+b", r"(a|aa)+b", r"(a|aa)+$", r"(.*a){20}", r"((a*)*)*b", r"(x+x+)+y", r"(a|a?)+b",
                r"(?:a+){10}c", r"(.*a){20}b"]


def test_catastrophic_patterns_take_linear_time():
    """Patterns that make a backtracking engine take exponential time against a run of ``a``s cost about what a
    plain pattern does, fed the same 20,000 characters four at a time (bounds relative to that, generous)."""

    def feed(patterns: list[str]) -> float:
        matcher, text = StopRegexes(patterns), ""
        start = time.perf_counter()
        for _ in range(5000):
            text += "aaaa"
            if matcher.search(text, 0) is not None:
                break
        return time.perf_counter() - start

    plain = feed(["zzz"])
    for pattern in CATASTROPHIC:
        took = feed([pattern])
        assert took < 20 * plain + 0.5, f"{pattern}: {took:.3f} s against {plain:.3f} s for a plain pattern"
    every = feed(CATASTROPHIC)
    assert every < 20 * plain + 0.5, f"all at once: {every:.3f} s against {plain:.3f} s"


def test_a_request_over_its_cpu_budget_fails_alone():
    """``x.*a`` against ``a``s rescans the whole text each step (quadratic): past its budget it raises
    InvalidRequest naming stop_regex; a plain pattern with the same budget over the same text does not."""
    costly, plain = StopRegexes([r"(?s)x.*a"], budget_s=0.05), StopRegexes([r"\n\n"], budget_s=0.05)
    text = ""
    with pytest.raises(InvalidRequest, match="CPU budget") as exc:
        for _ in range(20_000):
            text += "aaaaaaaa"
            assert plain.search(text, 0) is None
            costly.search(text, 0)
    assert exc.value.param == "stop_regex"
    assert plain.search(text + "b\n\n", 0) == (len(text) + 1, r"\n\n")


@pytest.mark.parametrize("pattern,why", [(r"(a)\1", "invalid escape"), (r"a(?=b)", "(?="), (r"(?<!a)b", "(?<!"),
                                         (r"(?P<x>a)(?P=x)", "(?P="), ("(", "missing )"), (r"\p{L}{300}", "too large"),
                                         (r"end\Q.", "\\Q")])
def test_patterns_re2_cannot_run_are_refused_naming_stop_regex(pattern, why):
    with pytest.raises(InvalidRequest, match=re.escape(why)) as exc:
        SamplingParams(stop_regex=["ok", pattern])
    assert exc.value.param == "stop_regex" and "stop_regex" in str(exc.value)


@pytest.fixture(scope="module")
def core(smollm2_path):
    from radixserve.actors.tokenizer import TokenizerCore

    return TokenizerCore(smollm2_path)


def test_the_tokenizer_actor_fails_only_the_request_over_budget(core):
    """In one TokenBatch, the request whose stop_regex is over its budget gets a 400 naming stop_regex and the
    scheduler is told to free it; the request beside it gets its text and goes on."""
    import asyncio

    from radixserve.actors.tokenizer_actor import TokenizerActor
    from radixserve.wire.messages import FinishReq, GenerateReq, RequestError, TextBatch, TokenBatch

    class Recorder:
        def __init__(self) -> None:
            self.sent: list[tuple[str, object]] = []

        async def send(self, peer: str, msg) -> None:
            self.sent.append((peer, msg))

    channel = Recorder()
    actor = TokenizerActor(core, channel)
    token = core.encode(" a")[0]

    async def main():
        await actor.handle(GenerateReq("costly", SamplingParams(stop_regex=r"(a+)+b"), text="x"))
        await actor.handle(GenerateReq("plain", SamplingParams(stop_regex=r"(a+)+b"), text="x"))
        actor.live["costly"].detok.stop_regexes.budget_s = 0.0  # any check is over
        await actor.handle(TokenBatch(["costly", "plain"], np.array([token] * 2), np.array([3, 3]), np.array([0, 0]),
                                      {}))

    asyncio.run(main())
    errors = [m for _, m in channel.sent if isinstance(m, RequestError)]
    assert [(e.rid, e.status, e.param) for e in errors] == [("costly", 400, "stop_regex")]
    assert "CPU budget" in errors[0].message
    assert [(peer, m.rid) for peer, m in channel.sent if isinstance(m, FinishReq)] == [("scheduler", "costly")]
    deltas = [d for _, m in channel.sent if isinstance(m, TextBatch) for d in m.deltas]
    assert [d.rid for d in deltas] == ["plain"] and list(actor.live) == ["plain"]


def test_a_match_that_began_in_text_already_handed_out_is_cut_from_the_whole_result(core):
    """", a" is handed out a token at a time; then "ab" completes a match of (a+)+b that began at the first "a". The
    last delta says how much of what was handed out the final text drops, and the whole results (SGLang's and
    OpenAI's) are cut before the match, as re.search says -- not just before the last token."""
    from radixserve.actors.api.openai import Choice
    from radixserve.actors.api.sglang_generate import GenerateOutput
    from radixserve.actors.tokenizer import OutputText
    from radixserve.wire.messages import FinishReason, TokenBatch

    pieces = [", a", "ab"]
    ids = [core.encode(p) for p in pieces]
    live = {"r": OutputText(core.detokenizer(SamplingParams(stop_regex=r"(a+)+b")))}
    native, choice, deltas = GenerateOutput("r", None), Choice(0), []
    for token in [t for piece in ids for t in piece]:
        batch = TokenBatch(["r"], np.array([token]), np.array([1]), np.array([0]), {})
        for d in core.detokenize(batch, live).deltas:
            deltas.append(d)
            native.add(d)
            choice.add(d)
    text = "".join(pieces)
    want = text[: re.search(r"(a+)+b", text).start()]
    assert deltas[-1].finish == FinishReason("stop", matched=r"(a+)+b") and deltas[-1].cut > 0
    assert native.text == choice.text == want == ", "


def test_the_engine_fails_only_the_request_over_budget(tiny_models):
    """The offline Engine goes through the same detokenizing: the request over its budget ends with its error (400,
    the pattern named), the one beside it runs to its length."""
    from radixserve.engine import Engine

    with Engine(str(tiny_models["llama"]), dtype="float32", max_total_tokens=400) as engine:
        engine.tokenizer.stop_regex_budget_s = 0.0  # every request made from here on: any check is over
        outs = engine.generate(["one", "two"], [{"max_new_tokens": 8, "temperature": 0, "stop_regex": r"(a+)+b"},
                                                {"max_new_tokens": 8, "temperature": 0}])
    error = outs[0]["meta_info"]["error"]
    assert error["status"] == 400 and "stop_regex" in error["message"] and "CPU budget" in error["message"]
    assert "error" not in outs[1]["meta_info"] and outs[1]["meta_info"]["completion_tokens"] == 8


def test_a_hostile_stop_regex_beside_a_normal_request(tiny_server, tiny_models):
    """The issue's case: a request whose logit_bias makes the model write ``a``s, with stop_regex patterns that
    backtrack exponentially on them, runs beside a normal request -- which finishes at its pace alone (a generous
    bound), while the hostile one runs to its length; a backreference is a 400 naming stop_regex."""
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(tiny_models["llama"]).encode("a", add_special_tokens=False)
    assert len(a) == 1
    hostile = {"text": "x", "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True,
                                                "logit_bias": {str(a[0]): 100},
                                                "stop_regex": [r"(a+)+b", r"(a|aa)+c", r"(.*a){20}b", r"((a*)*)*b"]}}
    normal = {"text": "Hello", "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}}

    def post(body: dict) -> tuple[dict, float]:
        start = time.perf_counter()
        r = httpx.post(tiny_server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json(), time.perf_counter() - start

    alone = min(post(normal)[1] for _ in range(2))
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(post, hostile)
        time.sleep(0.2)  # the hostile one is decoding (its text growing) when the normal one arrives
        out, beside = pool.submit(post, normal).result()
        bad_out, _ = bad.result()
    assert out["meta_info"]["completion_tokens"] == 60
    assert beside < 4 * alone + 3, f"the normal request took {beside:.2f} s beside the hostile one, {alone:.2f} s alone"
    assert bad_out["text"] == "a" * 200 and bad_out["meta_info"]["finish_reason"]["type"] == "length"
    r = httpx.post(tiny_server.url + "/generate", json={"text": "x", "sampling_params": {"stop_regex": [r"(a)\1"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.stop_regex", r.text
    assert "backreferences" in r.json()["error"]["message"]
