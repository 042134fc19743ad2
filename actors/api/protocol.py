"""Request bodies of the HTTP API as msgspec Structs: decoding *is* validation (types, ranges, unknown fields).

OpenAI's fields, plus the common SGLang/vLLM extras (top_k, min_p, ignore_eos, stop_token_ids). Fields OpenAI
has but radixserve does not implement are declared so that using them gives a clear 400, not a silent no-op. The
generation requests ignore top-level fields they do not declare, as SGLang's do (unknown_fields.py); everything
nested in them, and every other body, refuses unknown fields.
Every field is bounded (ids, priorities, map sizes): nothing a client sends can overflow what the actors exchange.
The sampling values are checked by SamplingParams itself and the prompts by ``radixserve.prompts``, the same code
the offline Engine runs.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from radixserve.actors.api.errors import APIError
from radixserve.prompts import Prompts, parse_prompts
from radixserve.sampling_params import SamplingParams

PositiveInt = Annotated[int, Meta(ge=1)]
Priority = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]  # larger = more important (unless the server says not)
RequestId = Annotated[str, Meta(min_length=1, max_length=256)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for function names


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None


class ToolDef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDef


class FunctionRef(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    """``tool_choice`` naming the function to call: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: FunctionRef


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI's: a JSON object as text (an object is taken too)


class MessageToolCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A call an earlier assistant message made, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    tool_calls: list[MessageToolCall] | None = None  # an assistant message: the calls it made

    def text(self, index: int) -> str:
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            if self.role == "assistant":
                return ""
            raise APIError(400, f"messages[{index}] ({self.role}) has no content", param=f"messages[{index}].content")
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{index}].content[{j}]: only text parts ({{\"type\": \"text\", "
                                    f"\"text\": ...}}) are supported", param=f"messages[{index}].content[{j}]")
            parts.append(part["text"])
        return "".join(parts)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The chat as the chat template takes it (``developer`` is OpenAI's newer name for ``system``). An assistant's
    ``tool_calls`` go with their arguments as objects (the templates write them with ``tojson``), a tool message
    with its ``tool_call_id``; ``name`` where given."""
    out = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]")
                                     for j, c in enumerate(m.tool_calls)]
        out.append(message)
    return out


def _template_call(call: MessageToolCall, where: str) -> dict[str, Any]:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            args = None
    if not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object (as text)",
                       param=f"{where}.function.arguments")
    return {**({"id": call.id} if call.id is not None else {}), "type": "function",
            "function": {"name": call.function.name, "arguments": args}}


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's response_format: plain text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema(self) -> str | None:
        """The JSON schema the output must follow (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.json_schema is None or self.json_schema.schema is None:
            raise APIError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                "{...}}}", param="response_format.json_schema")
        return msgspec.json.encode(self.json_schema.schema).decode()


class _Common(msgspec.Struct, kw_only=True):  # undeclared fields: unknown_fields.py
    model: str | None = None  # None: the served model (as SGLang, vLLM and llama.cpp do)
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    n: Annotated[int, Meta(ge=1, le=64)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100]
    user: str | None = None
    # SGLang / vLLM extras
    top_k: int | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None  # vLLM's name (SGLang's: min_new_tokens)
    min_new_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # RE2 patterns; the output ends before the first match
    skip_special_tokens: bool = True
    priority: Priority | None = None  # priority scheduling / policies; None: the server's default
    # structured output: OpenAI's response_format, or SGLang's regex / json_schema / ebnf (one of them)
    response_format: ResponseFormat | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None  # GBNF (SGLang's syntax) or Lark
    # SGLang's: a named logit processor the server enables (--logit-processors), and its parameters
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None

    def moot_fields(self) -> list[str]:
        """Declared fields this request's answer ignores (SGLang accepts them too): named in X-Ignored-Fields."""
        return ["stream_options"] if self.stream_options is not None and not self.stream else []

    def sampling_params(self, max_tokens: int | None, vocab_size: int | None) -> SamplingParams:
        """One choice's parameters (choice i of n: ``.choice(i)``, seed + i). InvalidRequest (a 400 naming the
        field) if a value is out of its range."""
        if self.min_tokens is not None and self.min_new_tokens is not None and self.min_tokens != self.min_new_tokens:
            raise APIError(400, "min_tokens and min_new_tokens are the same setting; give one", param="min_tokens")
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_new_tokens=self.min_tokens or self.min_new_tokens or 0,
            logit_bias=self.logit_bias,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            stop_regex=self.stop_regex,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            regex=self.regex,
            json_schema=self.constraint_schema,
            ebnf=self.ebnf,
            custom_logit_processor=self.custom_logit_processor,
            custom_params=self.custom_params,
        )
        if vocab_size is not None:
            params.check_model(vocab_size)
        return params

    @property
    def constraint_schema(self) -> str | None:
        from_format = self.response_format.schema() if self.response_format is not None else None
        if from_format is not None and (self.json_schema is not None or self.regex is not None or
                                        self.ebnf is not None):
            raise APIError(400, "give response_format or regex / json_schema / ebnf, not both",
                           param="response_format")
        return from_format if from_format is not None else self.json_schema

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # None: true; false: a required call is exactly one
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    # SGLang's assistant prefill: a last message of the assistant's is continued, not closed (else: no effect)
    continue_final_message: bool = False

    def validate(self) -> None:
        if not self.messages:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        self.check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    def check_tools(self) -> None:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise APIError(400, f"tools offer the function {twice!r} twice; give each function once", param="tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which tools do not offer "
                                f"({', '.join(names) or 'no tools given'})", param="tool_choice")
        if choice == "required" and not names:
            raise APIError(400, "tool_choice required needs tools to choose from", param="tool_choice")

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprobs_count(self) -> int | None:
        """None: no logprobs; else how many alternatives come with each token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def validate(self, vocab_size: int | None) -> Prompts:
        """The prompts: strings, or token-id lists."""
        if self.suffix:
            raise APIError(400, "suffix is not supported by radixserve", param="suffix")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of other than n is not supported by radixserve", param="best_of")
        return parse_prompts(self.prompt, "prompt", "any", vocab_size)

    @property
    def max_new_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class GenerateBody(msgspec.Struct, kw_only=True):
    """SGLang's /generate (what its frontend and ``Runtime.generate`` send; null means the default). Fields it
    does not declare are ignored, or refused where their value matters (unknown_fields.py), as SGLang's are."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # token ids, or a list of token-id lists
    sampling_params: SamplingParams | list[SamplingParams] | None = None  # one for all, or one per prompt
    stream: bool = False
    return_logprob: bool | None = False
    logprob_start_len: int | None = None  # the prompt's logprobs from here on; -1 / None: none
    top_logprobs_num: Annotated[int, Meta(ge=0, le=20)] | None = 0
    return_text_in_logprobs: bool = False
    rid: RequestId | list[RequestId] | None = None  # one id, or one per prompt
    priority: Priority | None = None
    # a named logit processor (--logit-processors): one for every prompt, or one per prompt; its parameters are
    # sampling_params.custom_params (SGLang's fields)
    custom_logit_processor: str | list[str | None] | None = None

    def num_sequences(self) -> int:
        """Prompts x n (a list of sampling_params that does not match the prompts is refused later)."""
        prompts = 1
        if isinstance(self.text, list):
            prompts = len(self.text)
        elif self.text is None and self.input_ids and isinstance(self.input_ids[0], list):
            prompts = len(self.input_ids)
        params = self.sampling_params
        if isinstance(params, list):
            return sum(p.n for p in params) if len(params) == prompts else prompts
        return prompts * (params.n if params is not None else 1)


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's (and vLLM's) /tokenize: exactly one of ``prompt`` (a string or a list) and ``messages``."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None  # with messages: rendered by the chat template, as a chat's are
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # with messages: end with the assistant's turn opening, as a chat does

    def validate(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if self.messages is not None and not self.messages:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        if self.tools is not None and self.messages is None:
            raise APIError(400, "tools go with messages (a chat), not with a prompt", param="tools")


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's /detokenize: ``tokens`` a list of token ids, or a list of such lists."""

    model: str | None = None
    tokens: list[Any]
    skip_special_tokens: bool = True

    def token_lists(self, vocab_size: int | None) -> tuple[list[list[int]], bool]:
        """The id lists and whether one list was sent (an empty list decodes to "")."""
        if not self.tokens:
            return [[]], True
        prompts = parse_prompts(self.tokens, "tokens", "ids", vocab_size)
        return prompts.items, prompts.single


class AbortBody(msgspec.Struct, forbid_unknown_fields=True):
    rid: RequestId


class PoliciesBody(msgspec.Struct, forbid_unknown_fields=True):
    eviction: Annotated[str, Meta(min_length=1)] | None = None
    schedule: Annotated[str, Meta(min_length=1)] | None = None
    write: Annotated[str, Meta(min_length=1)] | None = None  # the KV tiers' (--enable-hierarchical-cache)
    prefetch: Annotated[str, Meta(min_length=1)] | None = None
    draft: Annotated[str, Meta(min_length=1)] | None = None  # speculative decoding's (--speculative-algorithm)
    replica: Annotated[int, Meta(ge=0)] | None = None  # with --dp: only this replica (default: all)
