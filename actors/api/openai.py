"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions (JSON and SSE streaming).

Streamed chunks are shaped as SGLang's: a completion's finish_reason rides on its last text chunk; a chat's deltas
carry ``reasoning_content: null`` (clients read it) and its finish comes in a chunk of its own.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from aiohttp import web

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.http_io import decode_body, first_deltas, json_response, merged, stream_events
from radixserve.actors.api.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeBody, TokenizeBody, template_messages,
)
from radixserve.actors.api.server import ApiServer
from radixserve.actors.api.tool_calls import ToolUse
from radixserve.actors.api.unknown_fields import note_ignored
from radixserve.tool_parsers.reader import Reader
from radixserve.wire.messages import Delta, FinishReason, GenerateReq, prediction_details, tier_details, TokenLogprob

Kind = Literal["chat", "completion"]


@dataclass
class Choice:
    """What one choice accumulated (non-streaming) plus the usage counts every choice reports."""

    index: int
    echo: str = ""  # a completion's prompt, echoed before its text
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tiers: list[int] | None = None  # with KV tiers: cached_tokens from the pool, host memory, storage
    drafts: list[int] | None = None  # speculative decoding: [draft tokens, accepted], when it drafted
    finish: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # echo with logprobs: the prompt's
    # streaming: logprobs not sent yet (their tokens' text is held back: a stop string's prefix, half a character)
    unsent: list[TokenLogprob] = field(default_factory=list)
    unsent_prompt: list[TokenLogprob] = field(default_factory=list)
    sent: str = ""  # streaming: the text sent so far
    started: bool = False  # a chunk of it has been streamed

    def add(self, d: Delta) -> None:
        self.text = self.text[: len(self.text) - d.cut] + d.text
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = (d.prompt_tokens, d.completion_tokens,
                                                                          d.cached_tokens)
        self.finish = d.finish or self.finish
        self.cached_tiers = d.cached_tiers or self.cached_tiers
        self.drafts = d.drafts or self.drafts
        self.logprobs.extend(d.logprobs or ())
        self.prompt_logprobs.extend(d.prompt_logprobs or ())
        self.unsent.extend(d.logprobs or ())
        self.unsent_prompt.extend(d.prompt_logprobs or ())

    def take(self) -> tuple[str, list[TokenLogprob], list[TokenLogprob]]:
        """Streaming: what the next chunk sends -- the text so far not sent, the prompt's and the output's
        logprobs not sent -- now counted as sent."""
        new, prompt, output = self.text[len(self.sent):], self.unsent_prompt, self.unsent
        self.sent, self.unsent_prompt, self.unsent = self.text, [], []
        return new, prompt, output

    def completion_logprobs(self, prompt: list[TokenLogprob], output: list[TokenLogprob],
                            before: str) -> dict[str, Any]:
        """OpenAI's legacy logprobs of ``prompt`` tokens (echoed: offsets from 0) then ``output`` tokens (offsets
        after the echo and ``before``, the text already out)."""
        head, tail = completion_logprobs(prompt, 0), completion_logprobs(output, len(self.echo) + len(before))
        return {key: head[key] + tail[key] for key in head}


def finish_reason(f: FinishReason | None, tool_calls: bool = False) -> str | None:
    """OpenAI's value: ``stop``, ``length``, or ``tool_calls`` when the choice made calls and stopped (its clients
    know no other). A request aborted part-way (by /abort_request, or because its group failed) stopped early:
    ``stop``; SGLang's /generate keeps ``abort``, and ``matched_stop`` says what matched."""
    if f is None:
        return None
    return "length" if f.type == "length" else "tool_calls" if tool_calls and f.type == "stop" else "stop"


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, lp: float) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(tok, lp) for tok, _, lp in t.top]}
                        for t in items]}


def completion_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets, at = [], offset
    for t in items:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [None if t.logprob is None else {tok: lp for tok, _, lp in t.top} for t in items],
            "text_offset": offsets}


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not once per choice), as OpenAI does."""
    firsts = choices[::n]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.completion_tokens for c in choices)
    details: dict[str, Any] = {"cached_tokens": sum(c.cached_tokens for c in firsts)}
    tiers = [c.cached_tiers for c in firsts if c.cached_tiers is not None]
    if tiers:  # with KV tiers: the total split by where it came from
        details["cached_tokens_details"] = tier_details([sum(t[i] for t in tiers) for i in range(3)])
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": details}
    drafts = [c.drafts for c in choices if c.drafts is not None]
    if drafts:  # speculative decoding: how many of its draft tokens were kept
        out["completion_tokens_details"] = prediction_details(drafts)
    return out


class OpenAIRoutes:
    def __init__(self, server: ApiServer) -> None:
        from radixserve.tool_parsers import load_tool_parser

        self.server = server
        name = server.info.get("tool_call_parser")  # --tool-call-parser, resolved by the tokenizer actor
        self.tool_parser = load_tool_parser(name) if name else None

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)  # a hub id holds a slash
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        for prefix in ("", "/v1"):  # SGLang serves both
            app.router.add_post(f"{prefix}/tokenize", self.tokenize)
            app.router.add_post(f"{prefix}/detokenize", self.detokenize)

    @property
    def model_name(self) -> str:
        return self.server.info["model"]

    @property
    def model_names(self) -> list[str]:
        """Every name the model is served by (--served-model-name's aliases), the primary first."""
        return self.server.info.get("served_model_names") or [self.model_name]

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not serve; any of its names is served, and no name at all means the
        primary one. A response names the model as its request did."""
        names = self.model_names
        if name is not None and name not in names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                           f"{', '.join(f'`{n}`' for n in names)}", param="model", code="model_not_found")

    def card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.server.info["started"], "owned_by": "radixserve",
                "root": self.model_name, "max_model_len": self.server.info["context_length"]}

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI's model list: one card per served name (--served-model-name), the first first."""
        return json_response({"object": "list", "data": [self.card(name) for name in self.model_names]})

    async def model(self, request: web.Request) -> web.Response:
        """One served name's card; 404 (OpenAI's error) for a name this server does not serve."""
        name = request.match_info["model"]
        self.check_model(name)
        return json_response(self.card(name))

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"tokens", "count", "max_model_len"}``: a list and a number for one prompt (or one chat), lists of
        them for a list of prompts."""
        body = await decode_body(request, TokenizeBody)
        body.validate()
        self.check_model(body.model)
        if body.messages is not None:
            tools = [msgspec.to_builtins(t) for t in body.tools] if body.tools else None
            reply = await self.server.text("tokenize", messages=template_messages(body.messages), tools=tools,
                                           add_generation_prompt=body.add_generation_prompt)
        else:
            texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            reply = await self.server.text("tokenize", texts=texts, add_special_tokens=body.add_special_tokens)
        tokens = reply["tokens"]
        counts = [len(t) for t in tokens]
        one = not isinstance(body.prompt, list)
        return json_response({"tokens": tokens[0] if one else tokens, "count": counts[0] if one else counts,
                              "max_model_len": self.server.info["context_length"]})

    async def detokenize(self, request: web.Request) -> web.Response:
        """``{"text"}``: a string for one list of ids, a list of strings for a list of lists."""
        body = await decode_body(request, DetokenizeBody)
        self.check_model(body.model)
        lists, one = body.token_lists(self.server.limits.vocab_size)
        texts = (await self.server.text("detokenize", token_ids=lists,
                                        skip_special_tokens=body.skip_special_tokens))["texts"]
        return json_response({"text": texts[0] if one else texts})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's chat completions: the model's chat template applied to ``messages``; streamed as server-sent
        events with ``stream``."""
        body = await decode_body(request, ChatCompletionRequest)
        note_ignored(request, body.moot_fields())
        body.validate()
        self.check_model(body.model)
        messages = body.template_messages()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        vocab = self.server.limits.vocab_size
        params = body.sampling_params(body.max_new_tokens, vocab)
        tools = ToolUse.of(body, self.tool_parser)
        if tools is not None:
            params = tools.sampling_params(params)
        gens = [GenerateReq(f"{rid}-{i}", params.choice(i), messages=messages, top_logprobs=body.top_logprobs_count,
                            priority=body.priority, continue_final_message=body.continue_final_message,
                            tools=tools.template_tools if tools is not None else None)
                for i in range(body.n)]
        return await self.respond(request, "chat", rid, body, gens, tools=tools)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's (legacy) completions: ``prompt`` as text, token ids or a list of either; streamed with
        ``stream``; ``echo``, ``logprobs`` and ``n``."""
        body = await decode_body(request, CompletionRequest)
        note_ignored(request, body.moot_fields())
        vocab = self.server.limits.vocab_size
        prompts = body.validate(vocab).items
        self.check_model(body.model)
        rid = f"cmpl-{uuid.uuid4().hex}"
        self.server.check_size(len(prompts) * body.n)  # refused before a single sequence is built
        params = [body.sampling_params(body.max_new_tokens, vocab).choice(j) for j in range(body.n)]
        # echo with logprobs: the prompt's logprobs too, from its first token (which has none)
        start = 0 if body.echo and body.logprobs is not None else None
        gens = []
        for p, prompt in enumerate(prompts):
            for j in range(body.n):
                kw = {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
                gens.append(GenerateReq(f"{rid}-{p * body.n + j}", params[j], top_logprobs=body.top_logprobs_count,
                                        priority=body.priority, logprob_start=start, **kw))
        echo = await self.echo_texts(prompts) if body.echo else [""] * len(prompts)
        return await self.respond(request, "completion", rid, body, gens, [echo[i // body.n] for i in range(len(gens))])

    async def echo_texts(self, prompts: list[str | list[int]]) -> list[str]:
        """Each prompt as echoed: a string as sent, token ids decoded without special tokens (as SGLang does)."""
        ids = [p for p in prompts if not isinstance(p, str)]
        texts = iter((await self.server.text("detokenize", token_ids=ids, skip_special_tokens=True))["texts"]
                     if ids else ())
        return [p if isinstance(p, str) else next(texts) for p in prompts]

    async def respond(self, request: web.Request, kind: Kind, rid: str, body, gens: list[GenerateReq],
                      echo: list[str] | None = None, tools: ToolUse | None = None) -> web.StreamResponse:
        created = int(time.time())
        async with self.server.open(rid, gens, stream=body.stream) as group:
            firsts = await first_deltas(group)
            choices = [Choice(i, echo[i] if echo else "") for i in range(len(gens))]
            if not body.stream:
                async for i, delta in merged(group, firsts):
                    choices[i].add(delta)
                return json_response(self.final_body(kind, rid, created, choices, body, tools))
            return await stream_events(request, self.events(kind, rid, created, body, group, firsts, choices, tools))

    async def events(self, kind: Kind, rid: str, created: int, body, group, firsts, choices: list[Choice],
                     tools: ToolUse | None = None):
        """The SSE bodies of a streamed response, OpenAI's order: (a chat's role), content deltas, finish, usage."""
        head = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": created, "model": body.model or self.model_name}
        extra = {"usage": None} if body.include_usage else {}
        readers = [tools.reader() for _ in choices] if tools is not None else [None] * len(choices)
        if kind == "chat":
            for c in choices:
                yield {**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": "",
                                                                        "reasoning_content": None},
                                            "logprobs": None, "finish_reason": None, "matched_stop": None}], **extra}
        async for i, delta in merged(group, firsts):
            c = choices[i]
            c.add(delta)
            # a chunk whenever there is text to send, and one at the finish; logprobs go with their tokens' text
            if kind == "completion":
                if delta.text or delta.finish is not None or (c.echo and not c.started):
                    yield {**head, "choices": [self.completion_chunk(c, delta.finish, body)], **extra}
                continue
            if (reader := readers[i]) is not None:
                for choice in self.tool_chunks(tools, reader, c, delta.finish):
                    yield {**head, "choices": [choice], **extra}
                continue
            if delta.text:
                text, _, lps = c.take()
                yield {**head, "choices": [{"index": i, "delta": {"content": text, "reasoning_content": None},
                                            "logprobs": chat_logprobs(lps) if lps else None, "finish_reason": None,
                                            "matched_stop": None}], **extra}
            if delta.finish is not None:
                _, _, lps = c.take()  # the last token's (EOS: no text of its own)
                yield {**head, "choices": [{"index": i, "delta": {"reasoning_content": None},
                                            "logprobs": chat_logprobs(lps) if lps else None,
                                            "finish_reason": finish_reason(delta.finish),
                                            "matched_stop": delta.finish.matched}], **extra}
        if body.include_usage:
            yield {**head, "choices": [], "usage": usage(choices, body.n)}

    @staticmethod
    def tool_chunks(tools: ToolUse, reader: Reader, c: Choice, finish: FinishReason | None) -> list[dict[str, Any]]:
        """A streamed chat choice read for tool calls: a chunk when content or calls became final (with the
        logprobs of every token since the last chunk), then the finish."""
        content, calls = reader.feed(c.text[len(reader.text):], final=finish is not None)
        out = []
        if content or calls:
            _, _, lps = c.take()
            delta: dict[str, Any] = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = tools.calls(calls, first=len(reader.calls) - len(calls))
            out.append({"index": c.index, "delta": {**delta, "reasoning_content": None},
                        "logprobs": chat_logprobs(lps) if lps else None, "finish_reason": None, "matched_stop": None})
        if finish is not None:
            _, _, lps = c.take()
            out.append({"index": c.index, "delta": {"reasoning_content": None},
                        "logprobs": chat_logprobs(lps) if lps else None,
                        "finish_reason": finish_reason(finish, bool(reader.calls)), "matched_stop": finish.matched})
        return out

    def completion_chunk(self, c: Choice, finish: FinishReason | None, body) -> dict[str, Any]:
        """A streamed completion's next chunk: its first carries the echo (with logprobs, the prompt's too), its
        last the finish."""
        before = c.sent
        text, prompt_lps, lps = c.take()
        echo = "" if c.started else c.echo
        c.started = True
        lp = None
        if body.top_logprobs_count is not None and (prompt_lps or lps):
            lp = c.completion_logprobs(prompt_lps, lps, before)
        return {"index": c.index, "text": echo + text, "logprobs": lp, "finish_reason": finish_reason(finish),
                "matched_stop": finish.matched if finish else None}

    @staticmethod
    def chat_message(text: str, tools: ToolUse | None) -> dict[str, Any]:
        """A whole chat choice's message; with tools, its text read into content and ``tool_calls``."""
        message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None}
        if tools is not None:
            reader = tools.reader()  # None: tool_choice none, all of it is content
            content, calls = reader.read(text) if reader is not None else (text, [])
            message.update(content=content, tool_calls=tools.calls(calls) or None)
        return message

    def final_body(self, kind: Kind, rid: str, created: int, choices: list[Choice], body,
                   tools: ToolUse | None = None) -> dict[str, Any]:
        out = []
        for c in choices:
            message = self.chat_message(c.text, tools) if kind == "chat" else {}
            common = {"index": c.index, "finish_reason": finish_reason(c.finish, bool(message.get("tool_calls"))),
                      "matched_stop": c.finish.matched if c.finish else None}
            want_lp = body.top_logprobs_count is not None
            if kind == "chat":
                out.append({**common, "message": message,
                            "logprobs": chat_logprobs(c.logprobs) if want_lp else None})
            else:
                out.append({**common, "text": c.echo + c.text,
                            "logprobs": c.completion_logprobs(c.prompt_logprobs, c.logprobs, "") if want_lp
                            else None})
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
                "model": body.model or self.model_name, "choices": out, "usage": usage(choices, body.n)}
