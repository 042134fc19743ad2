"""Request fields a route does not declare: ignored, as SGLang ignores them, unless the value asks for something
radixserve does not do.

SGLang's /generate and its OpenAI routes ignore top-level fields they do not declare, and SGLang's own clients send
some of its fields with empty values on every request (``lora_path: ""``, ``return_routed_experts: false``,
``stream_options`` on /generate). So a top-level field that a lenient request struct (one declared without
``forbid_unknown_fields``) does not declare is accepted and ignored: named in the ``X-Ignored-Fields`` response
header, and logged once at debug level. Where ignoring the value would answer a different question than the one
asked -- a LoRA adapter named, an image sent, hidden states asked for -- the request is refused with a 400 naming
the field. Nested objects (``sampling_params``, ``messages``) stay strict, as SGLang's sampling params are.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

import msgspec
from aiohttp import web

from radixserve.actors.api.errors import APIError
from radixserve.errors import did_you_mean

log = logging.getLogger(__name__)

HEADER = "X-Ignored-Fields"
MAX_LISTED = 32  # names in the header; more are counted, not listed
MAX_NAME_CHARS = 64  # of one name, before percent-encoding

# SGLang's fields whose non-empty value changes what the request means, and what that value asks for. Only fields a
# route does not declare are looked up here: a field some route implements is that route's own.
UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(("lora_path", "lora_id"), "LoRA adapters"),
    **dict.fromkeys(("image_data", "video_data", "audio_data", "mm_hashes", "images_config", "video_config",
                     "mm_processor_kwargs"), "multimodal inputs (radixserve serves text models)"),
    "input_embeds": "prompts given as embeddings",
    **{f"return_{what}": f"{what.replace('_', ' ')} in the output" for what in (
        "hidden_states", "routed_experts", "indexer_topk", "bytes", "entropy", "prompt_token_ids", "token_ids",
        "sampling_mask", "cached_tokens_details", "spec_tokens_details", "meta_info", "input_ids_in_sglext",
        "output_ids_in_sglext")},
    "token_ids_logprob": "logprobs of chosen token ids",
    **dict.fromkeys(("session_id", "session_params"), "sessions"),
    "chat_template_kwargs": "chat template arguments",
    "no_stop_trim": "keeping the stop string in the output",
    **dict.fromkeys(("max_thinking_tokens", "require_reasoning"), "reasoning budgets"),
    "watermark": "watermarking",
    # requests that asked to be kept apart would share cached prefixes
    **dict.fromkeys(("cache_salt", "extra_key"), "separate prefix-cache namespaces"),
    **dict.fromkeys(("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size"),
                    "prefill/decode disaggregation"),
    "background": "background requests",
}

# a typed request key where aiohttp has them (newer versions warn about plain keys); the floor, 3.10.6, has none
IGNORED = web.RequestKey("ignored_fields", list) if hasattr(web, "RequestKey") else "radixserve.ignored_fields"


def empty(value: Any) -> bool:
    """A value that asks for nothing: null, false, "", {}, or a list of such (``lora_path: [null, null]``)."""
    if isinstance(value, list):
        return all(empty(v) for v in value)
    return value is None or value is False or value == "" or value == {}


def undeclared(raw: bytes, kind: type[msgspec.Struct]) -> list[str]:
    """The top-level fields of the JSON object ``raw`` that ``kind`` does not declare, in the body's order. An
    APIError (400 naming the field) for one whose value ``UNSUPPORTED`` says would change the request's meaning.
    ``raw`` has already decoded as ``kind``, so it is a JSON object."""
    try:
        top = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])  # the values are skipped, not parsed
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except msgspec.DecodeError as exc:  # a field name that is not UTF-8: the struct skipped it without reading it
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    names = [name for name in top if name not in kind.__struct_fields__]
    for name in names:
        if (what := UNSUPPORTED.get(name)) is not None:
            try:
                value = msgspec.json.decode(top[name])
            except RecursionError:
                value = True  # nested too deeply to be empty
            if not empty(value):
                shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
                raise APIError(400, f"{name}={shown}: radixserve does not implement {what}; leave {name} out (or "
                                    "empty) to run without it", param=name, code="unsupported_field")
    return names


class IgnoredLog:
    """Logs each ignored field name once (debug): a benchmark that sends the same extras with every request logs
    them once. It remembers at most ``limit`` names, so a client inventing names cannot grow it without bound."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self.seen: set[str] = set()

    def note(self, names: Iterable[str], path: str, known: Iterable[str]) -> None:
        fresh = [n for n in dict.fromkeys(names) if n not in self.seen][: self.limit - len(self.seen)]
        if not fresh:
            return
        self.seen.update(fresh)
        known = list(known)
        log.debug("ignoring request field(s) %s on %s, as SGLang does (named in the %s header; logged once)",
                  ", ".join(f"{n!r}{did_you_mean(n, known)}" for n in fresh), path, HEADER)


LOG: web.AppKey[IgnoredLog] = web.AppKey("ignored_log", IgnoredLog)


def note_ignored(request: web.Request, names: list[str], known: Iterable[str] = ()) -> None:
    """Record fields ``request`` sent that its answer ignores: its response names them in ``X-Ignored-Fields``."""
    if not names:
        return
    request[IGNORED] = [*request.get(IGNORED, []), *names]
    if (once := request.app.get(LOG)) is not None:
        once.note(names, request.path, known)


def header_value(names: list[str]) -> str:
    """The header's value: the names percent-encoded (so any name is one ASCII token without commas or line
    breaks), comma-separated, at most MAX_LISTED of them and then how many more."""
    shown = [quote(n[:MAX_NAME_CHARS], safe="") for n in dict.fromkeys(names)]
    more = len(shown) - MAX_LISTED
    return ", ".join(shown[:MAX_LISTED] + ([f"(and {more} more)"] if more > 0 else []))


async def _add_header(request: web.Request, response: web.StreamResponse) -> None:
    if names := request.get(IGNORED):
        response.headers[HEADER] = header_value(names)


def install(app: web.Application) -> None:
    """Every response of ``app`` (JSON, streamed, or an error) names the fields its request had ignored."""
    app[LOG] = IgnoredLog()
    app.on_response_prepare.append(_add_header)
