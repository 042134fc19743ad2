"""EBNF grammars (SGLang's ``ebnf``: GBNF syntax, Lark taken too): every output is a sentence of its grammar, through
the offline Engine, SGLang's /generate and the OpenAI routes' extra field; a bad or too complex grammar is refused
naming ``ebnf``."""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from radixserve import Engine, InvalidRequest, SamplingParams

# GBNF: rules, alternation, grouping, character classes, counted and open repetition, a comment
ANSWER = 'root ::= "The answer is " verdict "."\nverdict ::= "yes" | "no" | "maybe"  # one of three\n'
ANSWER_RE = r"The answer is (yes|no|maybe)\."
EMAIL = 'root ::= user "@" host ".com"\nuser ::= [a-z]{2,6}\nhost ::= [a-z] [a-z0-9]{1,5}\n'
EMAIL_RE = r"[a-z]{2,6}@[a-z][a-z0-9]{1,5}\.com"
LIST = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [1-9] digit?\ndigit ::= [0-9]\n'
LIST_RE = r"\[[1-9][0-9]?(,[1-9][0-9]?){0,3}\]"
LARK = 'start: "id-" DIGITS\nDIGITS: /[0-9]{3}/\n'
# a terminal whose automaton outgrows the lexer's fuel (the nested counted repetition of radixserve/structured.py's lexer-fuel note)
TOO_COMPLEX = 'root ::= "id: " x\nx ::= ( "a" [a]{499} ){500}\n'


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, max_total_tokens=600)


@pytest.mark.parametrize("grammar,pattern", [(ANSWER, ANSWER_RE), (EMAIL, EMAIL_RE), (LIST, LIST_RE),
                                             (LARK, r"id-[0-9]{3}")], ids=["answer", "email", "list", "lark"])
def test_outputs_are_sentences_of_the_grammar(engine, grammar, pattern):
    """Greedy and sampled (several seeds, one batch): each output matches and the grammar ended it."""
    params = [{"ebnf": grammar, "max_new_tokens": 40, "temperature": 0 if seed == 0 else 1.0, "seed": seed}
              for seed in range(4)]
    outs = engine.generate(["Tell me.", "Tell me.", "Go", "x y z"], params)
    for out in outs:
        assert re.fullmatch(pattern, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("grammar,message", [
    ("root ::= missing", "Rule 'missing' not found"),
    ('root ::= "a" (', "invalid ebnf"),
    ("start: undefined_rule", "invalid ebnf"),
    (TOO_COMPLEX, "too complex"),
], ids=["undefined-rule", "unclosed-group", "lark-undefined-rule", "too-complex"])
def test_bad_grammars_are_refused_naming_ebnf(grammar, message):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(ebnf=grammar)
    assert err.value.param == "ebnf" and message in str(err.value)


def test_one_constraint_at_a_time():
    for other in ({"regex": "a"}, {"json_schema": "{}"}):
        with pytest.raises(InvalidRequest, match="cannot both"):
            SamplingParams(ebnf=ANSWER, **other)


def test_generate_and_openai_extra(tiny_server):
    url = tiny_server.url
    got = httpx.post(url + "/generate", json={"text": "Q:", "sampling_params": {
        "ebnf": ANSWER, "max_new_tokens": 30, "temperature": 0}}, timeout=60).json()
    assert re.fullmatch(ANSWER_RE, got["text"]) and got["meta_info"]["finish_reason"]["type"] == "stop"
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "mail?"}],
                                          max_tokens=30, temperature=0.8, seed=3, extra_body={"ebnf": EMAIL})
    assert re.fullmatch(EMAIL_RE, chat.choices[0].message.content) and chat.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="list:", max_tokens=30, stream=True,
                                         extra_body={"ebnf": LIST})
    assert re.fullmatch(LIST_RE, "".join(c.choices[0].text for c in streamed))


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"text": "a", "sampling_params": {"ebnf": 'root ::= "a" ('}}, "sampling_params.ebnf"),
    ("/generate", {"text": "a", "sampling_params": {"ebnf": TOO_COMPLEX}}, "sampling_params.ebnf"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "ebnf": "root ::= nope"}, "ebnf"),
    ("/v1/completions", {"prompt": "a", "ebnf": TOO_COMPLEX}, "ebnf"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "ebnf": ANSWER,
                              "response_format": {"type": "json_object"}}, "response_format"),
])
def test_http_400_names_ebnf(tiny_server, path, body, param):
    r = httpx.post(tiny_server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
