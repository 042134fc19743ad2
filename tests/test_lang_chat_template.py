"""ChatTemplate: built-ins, dict round trip, and markers derived from real tokenizers' own chat templates,
checked by rendering conversations through the markers and comparing with ``apply_chat_template``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import radixserve.lang as sgl
from radixserve.lang import ChatTemplate

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' "
          "+ m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Llama-3.1 style: a system header (with a knowledge-date line) is always written, even without a system message
LLAMA31 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
           "{% set messages = messages[1:] %}{% else %}{% set sys = '' %}{% endif %}"
           "{{ '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n' + sys "
           "+ '<|eot_id|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
           " + m['content'] + '<|eot_id|>' }}{% endfor %}")
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' "
             "+ m['content'] + '<end_of_turn>\n' }}{% endfor %}")
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>",
            "<end_of_turn>"]

CONVERSATION = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Name a prime."}]
WITH_SYSTEM = [{"role": "system", "content": "Be brief."}] + CONVERSATION


def make_tokenizer(template: str | None, add_bos: bool) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{t: i + 1 for i, t in enumerate(SPECIALS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if add_bos:  # like Llama 3: encoding text adds BOS itself
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", vocab["<|begin_of_text|>"])])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", unk_token="[UNK]",
                                  additional_special_tokens=SPECIALS[1:])
    tok.chat_template = template
    return tok


def hf_render(tok: Any, messages: list[dict[str, str]], **kw: Any) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kw)


@pytest.fixture(scope="module")
def smol_tok(smollm2_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def test_smollm2_markers_default_system_and_exact_renders(smol_tok):
    ct = ChatTemplate.from_tokenizer(smol_tok)
    assert ct.roles == {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")}
    assert ct.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert ct.stop_str == ("<|im_end|>",)
    for messages in (CONVERSATION, WITH_SYSTEM):
        assert ct.render(messages) == hf_render(smol_tok, messages)


def test_smollm2_program_prompt_equals_apply_chat_template(smol_tok):
    """End to end: the text a program sends for a gen is what the model's own template makes."""
    ct = ChatTemplate.from_tokenizer(smol_tok)
    seen: list[dict[str, Any]] = []

    class Recorder:
        def model_info(self) -> dict[str, Any]:
            return {"model_path": "smol", "is_generation": True, "chat_template": ct.to_dict()}

        def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
            seen.append(payload)
            return {"text": "Hello! How can I help?", "output_ids": [], "meta_info": {}}

    @sgl.function
    def chat(s):
        s += sgl.user("Hi there")
        s += sgl.assistant(sgl.gen("reply"))
        s += sgl.user("Name a prime.")
        s += sgl.assistant(sgl.gen("prime"))

    state = chat.run(backend=Recorder())
    assert state.error() is None
    assert seen[0]["text"] == hf_render(smol_tok, CONVERSATION[:1], add_generation_prompt=True)
    assert seen[1]["text"] == hf_render(smol_tok, CONVERSATION, add_generation_prompt=True)
    assert seen[1]["sampling_params"]["stop"] == ["<|im_end|>"]


def test_llama3_style_markers_drop_the_bos_the_tokenizer_adds():
    tok = make_tokenizer(LLAMA3, add_bos=True)
    ct = ChatTemplate.from_tokenizer(tok)
    assert ct.roles["user"] == ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>")
    assert ct.roles["system"] == ("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>")
    assert ct.default_system_prompt is None and ct.stop_str == ("<|eot_id|>",)
    for messages in (CONVERSATION, WITH_SYSTEM):  # the server's tokenizer puts the BOS back when it encodes
        assert "<|begin_of_text|>" + ct.render(messages) == hf_render(tok, messages)
    assert ct == ChatTemplate.by_name("llama-3-instruct")


def test_leading_bos_that_is_not_a_marker_is_dropped_even_when_the_tokenizer_does_not_add_it():
    assert ChatTemplate.from_tokenizer(make_tokenizer(LLAMA3, add_bos=False)) == ChatTemplate.by_name("llama-3-instruct")


def test_injected_system_header_becomes_an_empty_default_system_prompt():
    tok = make_tokenizer(LLAMA31, add_bos=True)
    ct = ChatTemplate.from_tokenizer(tok)
    assert ct.default_system_prompt == ""  # "" still inserts the system markers, unlike None
    assert ct.roles["system"][0].endswith("Cutting Knowledge Date: December 2023\n\n")
    for messages in (CONVERSATION, WITH_SYSTEM):
        assert "<|begin_of_text|>" + ct.render(messages) == hf_render(tok, messages)


def test_template_that_rejects_system_falls_back_to_user_markers():
    tok = make_tokenizer(NO_SYSTEM, add_bos=False)
    with pytest.raises(Exception, match="System role not supported"):
        hf_render(tok, WITH_SYSTEM)
    ct = ChatTemplate.from_tokenizer(tok)
    assert ct.roles["system"] == ct.roles["user"] == ("<start_of_turn>user\n", "<end_of_turn>\n")
    assert ct.roles["assistant"] == ("<start_of_turn>model\n", "<end_of_turn>\n")
    assert ct.default_system_prompt is None and ct.stop_str == ("<end_of_turn>",)
    assert ct.render(CONVERSATION) == hf_render(tok, CONVERSATION)


def test_no_chat_template_gives_none():
    assert ChatTemplate.from_tokenizer(make_tokenizer(None, add_bos=False)) is None


def test_builtins_and_dict_round_trip():
    for name in ("chatml", "llama-3-instruct", "default"):
        ct = ChatTemplate.by_name(name)
        assert ChatTemplate.from_dict(ct.to_dict()) == ct
    plain = ChatTemplate.by_name("default")
    assert plain.render([{"role": "user", "content": "hi"}]) == "USER: hi\n" and plain.stop_str == ()
    assert ChatTemplate.by_name("chatml").stop_str == ("<|im_end|>",)
    with pytest.raises(ValueError, match="unknown chat template 'vicuna'"):
        ChatTemplate.by_name("vicuna")
    with pytest.raises(ValueError, match="missing"):
        ChatTemplate({"user": ("", "")})
    with pytest.raises(TypeError, match="roles"):
        ChatTemplate.from_dict({"stop_str": []})
