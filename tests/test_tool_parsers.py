"""Tool-call parsers on the outputs their formats' models write (the examples in SGLang's and vLLM's docs and tests,
written anew here): calls and content read whole and streamed in every split agree, no half marker is ever shown
as content, malformed calls are content, and every sentence of a parser's grammar reads as calls of its tools."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from radixserve.structured import _Bytes, limits
from radixserve.tool_parsers import available, infer_tool_parser, load_tool_parser
from radixserve.tool_parsers.base import Tool, ToolCall
from radixserve.tool_parsers.reader import Reader

NAMES = frozenset({"get_weather", "get_time", "add"})
W = '{"city": "Paris", "unit": "celsius"}'


def call(name: str, args: str) -> ToolCall:
    return ToolCall(name, json.dumps(json.loads(args), ensure_ascii=False))


# (parser, model output, content read whole, calls)
CASES = [
    # Hermes / Qwen: blocks anywhere, content around them
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', None,
     [call("get_weather", W)]),
    ("hermes", f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', "Let me check.",
     [call("get_weather", W), call("get_time", '{"zone": "CET"}')]),
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>', None,
     [call("add", '{"a": 1, "b": 2}')]),  # arguments sent as a JSON string
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}', None, [call("add", '{"a": 1}')]),  # unclosed
    ("hermes", 'Sure: <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> done',
     'Sure: <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> done', []),  # broken JSON
    ("hermes", '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>', []),  # not an offered function
    ("hermes", "The tag <tool is not a call; 2 < 3 either.", "The tag <tool is not a call; 2 < 3 either.", []),
    ("hermes", "ends with a partial <tool_ca", "ends with a partial <tool_ca", []),
    # Llama 3.1 / 3.2 JSON
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [call("get_weather", W)]),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', None,
     [call("get_time", '{"zone": "CET"}')]),
    ("llama3", '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_time", "arguments": {}}', None,
     [call("add", '{"a": 1, "b": 2}'), call("get_time", "{}")]),
    ("llama3", '  {"answer": 42}', '  {"answer": 42}', []),  # JSON, but not a call
    ("llama3", '{"name": "add", "parameters": {"a": 1}} and then some words', " and then some words",
     [call("add", '{"a": 1}')]),
    ("llama3", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("llama3", '{"name": "add", "parameters": {"a": ', '{"name": "add", "parameters": {"a": ', []),  # cut off
    # Mistral
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W}}}]', None, [call("get_weather", W)]),
    ("mistral", 'I will add them.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3, "b": 4}}, '
                '{"name": "get_time", "arguments": {"zone": "UTC"}}]', "I will add them.",
     [call("add", '{"a": 3, "b": 4}'), call("get_time", '{"zone": "UTC"}')]),
    ("mistral", '[TOOL_CALLS]{"name": "add", "arguments": {"a": 3}}', None, [call("add", '{"a": 3}')]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3}', '[TOOL_CALLS] [{"name": "add", "arguments": '
                                                                      '{"a": 3}', []),
    ("mistral", "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
    # Pythonic (Llama 3.2 / 4)
    ("pythonic", "[get_weather(city='Paris', unit='celsius'), get_time(zone=\"CET\")]", None,
     [call("get_weather", W), call("get_time", '{"zone": "CET"}')]),
    ("pythonic", "<|python_start|>[add(a=-1, b=2.5)]<|python_end|>", None, [call("add", '{"a": -1, "b": 2.5}')]),
    ("pythonic", '[add(a=[1, (2, 3)], b={"k": None, "t": True, "f": false})]', None,
     [call("add", '{"a": [1, [2, 3]], "b": {"k": null, "t": true, "f": false}}')]),
    ("pythonic", "[add(1, 2)]", "[add(1, 2)]", []),  # positional arguments
    ("pythonic", "[add(a=os.system('x'))]", "[add(a=os.system('x'))]", []),  # not a literal: never evaluated
    ("pythonic", "[1] See the footnote.", "[1] See the footnote.", []),
    ("pythonic", "It is sunny.", "It is sunny.", []),
]


def chunkings(text: str) -> list[list[str]]:
    """The text in one piece, in characters, and in a few random splits."""
    rng = random.Random(len(text))
    out = [[text], list(text)]
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_streamed_agree(name, text, content, calls):
    parser = load_tool_parser(name)
    assert Reader(parser, NAMES).read(text) == (content, calls)
    for pieces in chunkings(text):
        reader, shown, got = Reader(parser, NAMES), "", []
        for k, piece in enumerate(pieces):
            more, new = reader.feed(piece, final=k == len(pieces) - 1)
            shown += more
            got += new
            # nothing shown is ever taken back: what is shown so far begins what the whole reading shows
            assert (content or "").startswith(shown), (pieces, shown)
        assert (shown, got) == (content or "", calls), pieces


def test_markers_are_held_back_while_they_may_begin():
    reader = Reader(load_tool_parser("hermes"), NAMES)
    assert reader.feed("Checking <tool") == ("Checking", [])  # the space waits too: it may sit before a call
    assert reader.feed("_call>\n") == ("", [])
    assert reader.feed('{"name": "add", "arguments": {"a": 1}}\n</tool_call>') == ("", [call("add", '{"a": 1}')])
    assert reader.feed("", final=True) == ("", [])
    reader = Reader(load_tool_parser("mistral"), NAMES)
    assert reader.feed("ok [TOOL") == ("ok", [])
    assert reader.feed("S and more") == (" [TOOLS and more", [])  # it was not the marker after all


def test_aliases_and_inference():
    assert {"hermes", "qwen", "qwen25", "llama3", "mistral", "pythonic"} <= set(available())
    assert type(load_tool_parser("qwen25")) is type(load_tool_parser("hermes"))
    with pytest.raises(ValueError, match="did you mean"):
        load_tool_parser("hermess")
    assert infer_tool_parser("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>") == "hermes"
    assert infer_tool_parser('{{ "[AVAILABLE_TOOLS]" }}{{ "[TOOL_CALLS]" }}') == "mistral"
    assert infer_tool_parser('Respond as {"name": function name, "parameters": dictionary of argument name and its '
                             'value}') == "llama3"
    assert infer_tool_parser("[func_name1(params_name1=params_value1), func_name2(params)]") == "pythonic"
    assert infer_tool_parser("{{ messages[0]['content'] }}") is None and infer_tool_parser(None) is None


TOOLS = [
    Tool("get_weather", {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city"], "additionalProperties": False}),
    Tool("get_time", {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 4},
                                                       "exact": {"type": "boolean"}}, "additionalProperties": False}),
    Tool("add", {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                                  "b": {"type": "number", "minimum": 0, "maximum": 9}},
                 "required": ["a", "b"], "additionalProperties": False}),
    Tool("noop", {"type": "object", "properties": {}, "additionalProperties": False}),
    Tool("paint", {"type": "object", "properties": {"color": {"$ref": "#/$defs/color"}}, "required": ["color"],
                   "additionalProperties": False, "$defs": {"color": {"enum": ["red", "blue"]}}}),
]


def sentences(grammar: str, count: int, seed: int) -> list[str]:
    """Random sentences of a Lark grammar: each step a random byte the grammar allows (the end, when allowed, half
    the time), on a vocabulary of single bytes."""
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

    compiled = LLMatcher.grammar_from_lark(grammar)
    assert not LLMatcher.validate_grammar(compiled, limits=limits())
    tokenizer = LLTokenizer(TokenizerWrapper(_Bytes()), slices=[])
    rng, out = random.Random(seed), []
    for _ in range(count):
        matcher, data = LLMatcher(tokenizer, compiled, log_level=0, limits=limits()), b""
        while not matcher.is_stopped() and len(data) < 4000:
            mask = matcher.compute_bitmask()
            allowed = [b for b in range(257) if mask[b >> 3] >> (b & 7) & 1]
            if 256 in allowed and (len(allowed) == 1 or rng.random() < 0.5):
                break
            byte = rng.choice([b for b in allowed if b != 256])
            assert matcher.consume_token(byte), matcher.get_error()
            data += bytes([byte])
        assert matcher.is_accepting(), data
        out.append(data.decode())
    return out


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral", "pythonic"])
@pytest.mark.parametrize("parallel", [False, True])
def test_every_sentence_of_the_grammar_reads_as_calls(name, parallel):
    parser = load_tool_parser(name)
    schemas = {t.name: t.parameters or {"type": "object"} for t in TOOLS}
    for offered in (TOOLS, TOOLS[:1], TOOLS[3:], TOOLS[4:]):
        names = frozenset(t.name for t in offered)
        for text in sentences(parser.grammar(offered, parallel), 12, seed=len(offered)):
            content, calls = Reader(parser, names).read(text)
            assert content is None and calls, text
            assert parallel or len(calls) == 1, text
            for c in calls:
                jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_tools_defining_one_name_differently_are_refused():
    from radixserve.errors import InvalidRequest

    other = Tool("repaint", {"properties": {"c": {"$ref": "#/$defs/color"}}, "$defs": {"color": {"type": "string"}}})
    with pytest.raises(InvalidRequest, match="differently"):
        load_tool_parser("hermes").grammar([TOOLS[4], other], True)


def test_pythonic_call_without_parameters():
    parser = load_tool_parser("pythonic")
    assert set(sentences(parser.grammar([Tool("noop", {})], False), 3, seed=0)) == {"[noop()]"}


def test_pythonic_grammar_needs_identifiers():
    from radixserve.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="identifiers"):
        load_tool_parser("pythonic").grammar([Tool("get-weather", {})], False)
    with pytest.raises(InvalidRequest, match="identifiers"):
        load_tool_parser("pythonic").grammar([Tool("f", {"properties": {"not ok": {}}})], False)


def test_mistral_ids_are_what_its_templates_take():
    ids = {load_tool_parser("mistral").call_id() for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert load_tool_parser("hermes").call_id().startswith("call_")
