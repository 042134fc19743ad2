"""OpenAI's Responses API (actors/api/responses.py) through the ``openai`` client: a response, its stream of typed
events, conversations chained by previous_response_id (the radix cache reusing the earlier turns), JSON output
under text.format, function calls (whole and streamed, and their outputs sent back), stored responses fetched and
deleted, and the fields not served refused by name."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from radixserve.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(tiny_models):
    proc = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens", "4096",
                         "--tool-call-parser", "hermes")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_a_response_and_its_stream_say_the_same(client):
    kw = {"input": "Tell me about lighthouses.", "instructions": "Be brief.", "max_output_tokens": 12,
          "temperature": 0}
    plain = client.responses.create(**kw)
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.output_text
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.usage.output_tokens == 12 and plain.usage.input_tokens > 0
    assert plain.output[0].role == "assistant" and plain.output[0].content[0].type == "output_text"
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == events[-1].response.output_text == plain.output_text


def test_a_conversation_chained_by_previous_response_id_reuses_its_cache(client, server):
    first = client.responses.create(input="My name is Ada. Remember it, please, for later.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, max_output_tokens=8,
                                     temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1  # the first turn, cached
    assert client.responses.retrieve(second.id).output_text == second.output_text
    assert httpx.delete(f"{server.url}/v1/responses/{first.id}").json()["deleted"] is True
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.create(input="Again?", previous_response_id=first.id)
    unstored = client.responses.create(input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_text_format_constrains_the_output_to_the_schema(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    out = client.responses.create(input="Is the sea salty?", max_output_tokens=64, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "verdict", "schema": schema}})
    assert json.loads(out.output_text)["answer"] in ("yes", "no") and out.status == "completed"
    assert out.text.format.type == "json_schema"


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}


def test_a_required_function_call_is_an_output_item_whole_and_streamed(client):
    kw = {"input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
          "parallel_tool_calls": False, "max_output_tokens": 64, "temperature": 0}
    out = client.responses.create(**kw)
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo") and out.status == "completed"
    events = list(client.responses.create(**kw, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == calls[0].arguments  # greedy: the same call
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert added[0].item.arguments == "" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the call's output goes back, and the conversation goes on from the stored one
    answer = client.responses.create(previous_response_id=out.id, tools=[WEATHER], max_output_tokens=6,
                                     temperature=0, input=[{"type": "function_call_output",
                                                            "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert answer.status == "incomplete" and answer.usage.input_tokens > out.usage.input_tokens


def test_function_call_items_in_the_input_need_json_object_arguments(server):
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "[1, 2]"}]
    bad = httpx.post(server.url + "/v1/responses", json={"input": items, "tools": [WEATHER]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[1].arguments"
    odd = httpx.post(server.url + "/v1/responses", json={"input": [{"type": "reasoning", "summary": []}]})
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "input[0].type"


@pytest.mark.parametrize("extra, field", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
])
def test_what_is_not_served_is_refused_by_name(client, extra, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="Hi", **extra)
    assert refused.value.body["param"] == field


def test_an_unknown_model_is_404_and_unknown_fields_are_ignored(server):
    url = server.url + "/v1/responses"
    assert httpx.post(url, json={"input": "Hi", "model": "nope"}).status_code == 404
    ok = httpx.post(url, json={"input": "Hi", "max_output_tokens": 2, "service_tier": "auto",
                               "prompt_cache_key": "k"})
    assert ok.status_code == 200 and ok.json()["output"][0]["content"][0]["text"] is not None
