"""``--chat-template``: a Jinja file, or one of a few built-in templates (data below), in place of the tokenizer's.

The built-ins are Hugging Face chat templates (``messages``, ``add_generation_prompt``, ``bos_token``,
``eos_token``), written as each model family's own template renders a conversation of system/user/assistant turns
(tools and multimodal content aside).
"""
from __future__ import annotations

from pathlib import Path

_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    # <|im_start|>role\n...<|im_end|> (SmolLM2, Qwen, many fine-tunes)
    "chatml": _CHATML,
    # Qwen2/2.5: ChatML with a default system turn
    "qwen": (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
        "{% endif %}" + _CHATML
    ),
    # Llama 3 / 3.1 / 3.2 Instruct
    "llama-3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
        " + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    # Llama 2 chat: the system prompt inside the first [INST] block
    "llama-2": (
        "{% if messages[0]['role'] == 'system' %}"
        "{% set system = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
        "{% set messages = messages[1:] %}"
        "{% else %}{% set system = '' %}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' + (system if loop.first else '') + message['content'] | trim + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
        "{% endif %}"
        "{% endfor %}"
    ),
    # Mistral Instruct (v0.1-v0.3): [INST] ... [/INST], the system prompt before the first user turn's text
    "mistral": (
        "{% if messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] + '\\n\\n' %}{% set messages = messages[1:] %}"
        "{% else %}{% set system = '' %}{% endif %}"
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
        "{% endif %}"
        "{% endfor %}"
    ),
}
ALIASES = {"llama-3-instruct": "llama-3", "llama-2-chat": "llama-2", "qwen2": "qwen"}  # SGLang's frontend names


def load_chat_template(value: str) -> str:
    """The Jinja text ``--chat-template value`` stands for: a built-in name, else a file's contents.
    ValueError naming the built-ins when it is neither."""
    name = ALIASES.get(value, value)
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name]
    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text()
        if not text.strip():
            raise ValueError(f"chat template file {str(path)!r} is empty")
        return text
    raise ValueError(f"--chat-template {value!r} is neither a file nor a built-in template; the built-ins are "
                     f"{', '.join(sorted(BUILTIN_TEMPLATES))} (aliases: {', '.join(sorted(ALIASES))})")
