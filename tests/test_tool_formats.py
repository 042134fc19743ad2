"""Each tool-call format on tiny random checkpoints whose own chat templates (written here, in each family's manner)
carry it: the template shows the tools and a conversation's calls and results, --tool-call-parser auto finds the
format in it, and under the format's grammar even a random model writes calls that read back as valid ones. One
checkpoint (the Mistral format: special markers, 9-character ids its template insists on) is served end to end."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from radixserve import Engine
from radixserve.actors.tokenizer import TokenizerCore
from radixserve.server_process import ServerProcess
from radixserve.tool_parsers import load_tool_parser, resolve_tool_parser
from radixserve.tool_parsers.base import Tool
from radixserve.tool_parsers.reader import Reader

HERMES = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Write a call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{{- bos_token }}
{%- if tools %}<|start_header_id|>user<|end_header_id|>

Answer with a function call if one helps. Respond in the format {"name": function name, "parameters": dictionary of \
argument name and its value}, nothing else.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{{ {"name": c.function.name, "parameters": c.function.arguments} | tojson }}\
{% endfor %}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{{- bos_token }}
{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}[INST] {{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] [
{%- for c in m.tool_calls %}
{%- if c.id is not defined or c.id | length != 9 %}{{ raise_exception("call ids are 9 letters or digits") }}{% endif %}
{{- {"name": c.function.name, "arguments": c.function.arguments, "id": c.id} | tojson }}{{ ", " if not loop.last }}
{%- endfor %}]{{ eos_token }}
{%- elif m.role == 'tool' %}[TOOL_RESULTS] {{ {"content": m.content, "call_id": m.tool_call_id} | tojson }}\
[/TOOL_RESULTS]
{%- else %}{{ m.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

PYTHONIC = """{%- if tools %}<|start_header_id|>system<|end_header_id|>

To call functions, reply only with [func_name1(params_name1=params_value1, params_name2=params_value2), \
func_name2(params)]. The functions: {{ tools | tojson }}<|eot_id|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

[{% for c in m.tool_calls %}{{ c.function.name }}(
{%- for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}{{ ", " if not loop.last }}{% endfor %})
{{- ", " if not loop.last }}{% endfor %}]<|eot_id|>
{%- else %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# format -> (its template, the tiny checkpoint it goes on, how the conversation's call shows in the prompt)
FORMATS = {
    "hermes": (HERMES, "qwen2", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'),
    "llama3": (LLAMA3, "llama", '{"name": "get_weather", "parameters": {"city": "Lima"}}'),
    "mistral": (MISTRAL, "mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}, '
                                    '"id": "a1b2c3d4e"}]'),
    "pythonic": (PYTHONIC, "llama", '[get_weather(city="Lima")]'),
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
        "additionalProperties": False}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                {"type": "function", "function": {"name": "get_time", "description": "Now", "parameters": TIME}}]
TOOLS = [Tool("get_weather", WEATHER), Tool("get_time", TIME)]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CONVERSATION = [
    {"role": "user", "content": "Weather in Lima?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a1b2c3d4e", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}]},
    {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "22 C"},
]


def with_template(checkpoint: Path, template: str, out: Path) -> Path:
    """``checkpoint``'s files (linked) with ``template`` as its own chat template."""
    out.mkdir()
    for f in checkpoint.iterdir():
        if f.name != "chat_template.jinja":
            (out / f.name).symlink_to(f)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").unlink()
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(template)
    return out


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tool_formats")
    return {name: with_template(tiny_models[kind], template, root / name)
            for name, (template, kind, _) in FORMATS.items()}


@pytest.mark.parametrize("name", FORMATS)
def test_the_template_shows_tools_and_the_format_is_found(checkpoints, name):
    core = TokenizerCore(checkpoints[name])
    assert resolve_tool_parser("auto", core.tokenizer.chat_template) == name
    prompt = core.decode(core.apply_chat_template(CONVERSATION, tools=OPENAI_TOOLS), skip_special_tokens=False)
    assert '"get_time"' in prompt and '"Now"' in prompt  # the tools, as the template shows them
    assert FORMATS[name][2] in prompt and "22 C" in prompt  # the call made and its result
    assert Reader(load_tool_parser(name), frozenset(SCHEMAS)).read(FORMATS[name][2])[1]  # reads back as a call


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(str(tiny_models["llama"]), dtype="float32", max_total_tokens=2000)


@pytest.mark.parametrize("name", FORMATS)
def test_a_random_model_under_the_grammar_makes_calls(engine, name):
    """tool_choice required (one call, or several) and a named function, sampled with several seeds."""
    parser = load_tool_parser(name)
    cases = [(TOOLS, False), (TOOLS, True), (TOOLS[1:], False)]
    params = [{"ebnf": parser.grammar(tools, parallel), "max_new_tokens": 200, "temperature": 1.0, "seed": seed}
              for tools, parallel in cases for seed in range(2)]
    outs = engine.generate(["Call a function."] * len(params), params)
    for k, out in enumerate(outs):
        tools, parallel = cases[k // 2]
        content, calls = Reader(parser, frozenset(t.name for t in tools)).read(out["text"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert content is None and calls and (parallel or len(calls) == 1), out["text"]
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.fixture(scope="module")
def mistral_server(checkpoints):
    server = ServerProcess("--model-path", str(checkpoints["mistral"]), "--dtype", "float32", "--max-total-tokens",
                           "2000", "--served-model-name", "tiny-mistral")
    yield server
    server.stop()


def test_served_mistral_format(mistral_server):
    """Inferred from the checkpoint's template; required and named calls, whole and streamed, with ids the
    template takes back in the next turn."""
    client = openai.OpenAI(base_url=mistral_server.url + "/v1", api_key="unused")
    ask = [{"role": "user", "content": "Weather?"}]
    r = client.chat.completions.create(model="tiny-mistral", messages=ask, tools=OPENAI_TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=0.8, seed=2)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed = list(client.chat.completions.create(
        model="tiny-mistral", messages=ask, tools=OPENAI_TOOLS, max_tokens=200, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}}))
    deltas = [t for c in streamed if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in deltas] == ["get_time"] and len(deltas[0].id) == 9
    assert not "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    follow = [*ask, r.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    after = client.chat.completions.create(model="tiny-mistral", messages=follow, tools=OPENAI_TOOLS, max_tokens=8)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")  # auto: whatever it wrote, no 500
