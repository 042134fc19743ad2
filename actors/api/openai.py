"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions (JSON and SSE streaming)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.io import decode_body, first_deltas, json_response, merged, stream_events
from radixserve.actors.api.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeBody, TokenizeBody, template_messages,
)
from radixserve.actors.api.server import ApiServer
from radixserve.actors.messages import Delta, FinishReason, GenerateReq, TokenLogprob

Kind = Literal["chat", "completion"]


@dataclass
class Choice:
    """What one choice accumulated (non-streaming) plus the usage counts every choice reports."""

    index: int
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = (d.prompt_tokens, d.completion_tokens,
                                                                          d.cached_tokens)
        self.finish = d.finish or self.finish
        self.logprobs.extend(d.logprobs or ())


def finish_reason(f: FinishReason | None) -> str | None:
    """OpenAI's value: ``stop`` or ``length`` only (its clients know no other). A request aborted part-way (by
    /abort_request, or because its group failed) stopped early: ``stop``; SGLang's native /generate keeps
    ``abort``, and ``matched_stop`` says what matched."""
    if f is None:
        return None
    return "length" if f.type == "length" else "stop"


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
            "top_logprobs": [{tok: lp for tok, _, lp in t.top} for t in items], "text_offset": offsets}


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not once per choice), as OpenAI does."""
    firsts = choices[::n]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)}}


class OpenAIRoutes:
    def __init__(self, server: ApiServer) -> None:
        self.server = server

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
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

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": self.server.info["started"], "owned_by": "radixserve",
            "root": self.model_name, "max_model_len": self.server.info["context_length"]}
            for name in self.model_names]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"tokens", "count", "max_model_len"}``: a list and a number for one prompt (or one chat), lists of
        them for a list of prompts."""
        body = await decode_body(request, TokenizeBody)
        body.validate()
        self.check_model(body.model)
        if body.messages is not None:
            reply = await self.server.text("tokenize", messages=template_messages(body.messages),
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
        body = await decode_body(request, ChatCompletionRequest)
        body.validate()
        self.check_model(body.model)
        messages = body.template_messages()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        vocab = self.server.limits.vocab_size
        params = body.sampling_params(body.max_new_tokens, vocab)
        gens = [GenerateReq(f"{rid}-{i}", params.choice(i), messages=messages, top_logprobs=body.top_logprobs_count,
                            priority=body.priority) for i in range(body.n)]
        return await self.respond(request, "chat", rid, body, gens)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await decode_body(request, CompletionRequest)
        vocab = self.server.limits.vocab_size
        prompts = body.validate(vocab).items
        self.check_model(body.model)
        rid = f"cmpl-{uuid.uuid4().hex}"
        self.server.check_size(len(prompts) * body.n)  # refused before a single sequence is built
        params = [body.sampling_params(body.max_new_tokens, vocab).choice(j) for j in range(body.n)]
        gens = []
        for p, prompt in enumerate(prompts):
            for j in range(body.n):
                kw = {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
                gens.append(GenerateReq(f"{rid}-{p * body.n + j}", params[j], top_logprobs=body.top_logprobs_count,
                                        priority=body.priority, **kw))
        echo = [prompts[i // body.n] if body.echo and isinstance(prompts[i // body.n], str) else ""
                for i in range(len(gens))]
        return await self.respond(request, "completion", rid, body, gens, echo)

    async def respond(self, request: web.Request, kind: Kind, rid: str, body, gens: list[GenerateReq],
                      echo: list[str] | None = None) -> web.StreamResponse:
        created = int(time.time())
        async with self.server.open(rid, gens, stream=body.stream) as group:
            firsts = await first_deltas(group)
            choices = [Choice(i) for i in range(len(gens))]
            if not body.stream:
                async for i, delta in merged(group, firsts):
                    choices[i].add(delta)
                return json_response(self.final_body(kind, rid, created, choices, body, echo))
            return await stream_events(request, self.events(kind, rid, created, body, group, firsts, choices, echo))

    async def events(self, kind: Kind, rid: str, created: int, body, group, firsts, choices: list[Choice],
                     echo: list[str] | None):
        """The SSE bodies of a streamed response, OpenAI's order: role, content deltas, finish, usage."""
        head = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": created, "model": body.model or self.model_name}
        extra = {"usage": None} if body.include_usage else {}
        if kind == "chat":
            for c in choices:
                yield {**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], **extra}
        for i, text in enumerate(echo or ()):
            if text:
                yield {**head, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}],
                       **extra}
        async for i, delta in merged(group, firsts):
            c = choices[i]
            offset = len(c.text)
            c.add(delta)
            if delta.text or delta.logprobs:
                yield {**head, "choices": [self.chunk(kind, i, delta, offset)], **extra}
            if delta.finish is not None:
                choice = {"index": i, "finish_reason": finish_reason(delta.finish), "logprobs": None,
                          "matched_stop": delta.finish.matched}
                choice.update({"delta": {}} if kind == "chat" else {"text": ""})
                yield {**head, "choices": [choice], **extra}
        if body.include_usage:
            yield {**head, "choices": [], "usage": usage(choices, body.n)}

    def chunk(self, kind: Kind, i: int, delta: Delta, offset: int) -> dict[str, Any]:
        lp = None
        if delta.logprobs:
            lp = chat_logprobs(delta.logprobs) if kind == "chat" else completion_logprobs(delta.logprobs, offset)
        if kind == "chat":
            return {"index": i, "delta": {"content": delta.text}, "logprobs": lp, "finish_reason": None}
        return {"index": i, "text": delta.text, "logprobs": lp, "finish_reason": None}

    def final_body(self, kind: Kind, rid: str, created: int, choices: list[Choice], body, echo) -> dict[str, Any]:
        out = []
        for c in choices:
            common = {"index": c.index, "finish_reason": finish_reason(c.finish),
                      "matched_stop": c.finish.matched if c.finish else None}
            want_lp = body.top_logprobs_count is not None
            if kind == "chat":
                out.append({**common, "message": {"role": "assistant", "content": c.text},
                            "logprobs": chat_logprobs(c.logprobs) if want_lp else None})
            else:
                prefix = echo[c.index] if echo else ""
                out.append({**common, "text": prefix + c.text,
                            "logprobs": completion_logprobs(c.logprobs, 0) if want_lp else None})
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
                "model": body.model or self.model_name, "choices": out, "usage": usage(choices, body.n)}
