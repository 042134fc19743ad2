"""Undeclared request fields (actors/api/unknown_fields.py) without a server: which values are empty, what the
header says for any name, and that each name is logged once."""
from __future__ import annotations

import logging

import msgspec
import pytest

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.protocol import GenerateBody
from radixserve.actors.api.unknown_fields import MAX_LISTED, IgnoredLog, empty, header_value, undeclared


@pytest.mark.parametrize("value", [None, False, "", {}, [], [None, ""], [[], {}]])
def test_empty_values_ask_for_nothing(value):
    assert empty(value)


@pytest.mark.parametrize("value", [True, "x", 0, 1, ["a", None], {"k": 1}, "last"])
def test_other_values_ask_for_something(value):
    assert not empty(value)


def test_undeclared_fields_in_the_bodys_order_and_a_refusal_naming_the_field():
    raw = msgspec.json.encode({"text": "a", "stream_options": {"include_usage": True}, "lora_path": "",
                               "rid": "r", "foo": [1, {"x": None}]})
    assert undeclared(raw, GenerateBody) == ["stream_options", "lora_path", "foo"]
    with pytest.raises(APIError) as exc:
        undeclared(msgspec.json.encode({"text": "a", "lora_path": "adapter-7"}), GenerateBody)
    assert (exc.value.status, exc.value.param, exc.value.code) == (400, "lora_path", "unsupported_field")
    assert "LoRA adapters" in exc.value.message and "'adapter-7'" in exc.value.message
    deep = b'{"text": "a", "image_data": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(APIError):  # too deep to read: not empty
        undeclared(deep, GenerateBody)


def test_the_header_is_ascii_tokens_and_bounded():
    assert header_value(["lora_path", "a,b", "x\r\nSet-Cookie: y", "é", "lora_path"]) == \
        "lora_path, a%2Cb, x%0D%0ASet-Cookie%3A%20y, %C3%A9"
    many = header_value([f"f{i}" for i in range(MAX_LISTED + 5)])
    assert many.endswith(f"f{MAX_LISTED - 1}, (and 5 more)") and len(header_value(["z" * 10_000])) == 64


def test_each_name_is_logged_once_and_the_memory_is_bounded(caplog):
    once = IgnoredLog(limit=3)
    with caplog.at_level(logging.DEBUG, logger="radixserve.actors.api.unknown_fields"):
        once.note(["temprature", "lora_path"], "/generate", ["temperature", "text"])
        once.note(["lora_path"], "/generate", [])
        once.note(["a", "b", "c"], "/generate", [])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(r.levelno == logging.DEBUG for r in caplog.records)
    assert "'temprature'; did you mean 'temperature'?" in lines[0] and "'lora_path'" in lines[0]
    assert "'a'" in lines[1] and "'b'" not in lines[1] and once.seen == {"temprature", "lora_path", "a"}


def test_a_field_name_that_is_not_utf8_is_a_400_not_a_500():
    """The struct skips an unknown key without reading it; the list of undeclared names must read it (the fuzzer
    sent ``"a\\xed\\xbf\\xbfb"``, a surrogate in UTF-8's form, which is not UTF-8)."""
    raw = b'{"text": "hi", "a\xed\xbf\xbfb": 1}'
    msgspec.json.decode(raw, type=GenerateBody)  # decodes: the key is skipped unread
    with pytest.raises(APIError) as refused:
        undeclared(raw, GenerateBody)
    assert refused.value.status == 400 and "not valid JSON" in refused.value.message
