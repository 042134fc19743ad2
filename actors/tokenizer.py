"""TokenizerCore: chat templates and encoding in, incremental detokenizing and stop strings out (no I/O).

Uses the checkpoint's own tokenizer and chat template through transformers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams
from radixserve.stop_regex import CPU_BUDGET_S, StopRegexes
from radixserve.wire.messages import (
    ControlReply, Delta, Finished, FinishReason, FinishReq, RequestError, ScoredPrompt, TextReq, TokenBatch,
    TokenLogprob,
)
from radixserve.wire.plans import Logprob


log = logging.getLogger(__name__)

# a whole (not streamed) result's tokens come from the scheduler in runs of this many: nobody reads them before
# the end, and each run is one message instead of one a token (SGLang sends such outputs every 50 tokens too)
WHOLE_RESULT_INTERVAL = 50


def output_interval(params: SamplingParams, stream: bool, stream_interval: int = 1) -> int:
    """How many new tokens the scheduler may hold back before it hands them on (``AddReq.output_interval``):
    ``stream_interval`` (--stream-interval) for a stream, WHOLE_RESULT_INTERVAL for a whole result, and 1
    whenever its text can end it (stop strings, stop_regex): each token is looked at as it comes, so the
    request ends on time, not some tokens later."""
    if params.stop_strings or params.stop_patterns_source:
        return 1
    return max(1, stream_interval) if stream else WHOLE_RESULT_INTERVAL


@dataclass
class Detokenized:
    """A step's tokens as text: the deltas for the client, the stops the scheduler must hear about (a stop
    string ended the request here), and the requests that fail here (tokens that could not be turned into text, a
    stop_regex over its CPU budget): each ends alone, the others go on."""

    deltas: list[Delta] = field(default_factory=list)
    stops: list[FinishReq] = field(default_factory=list)
    failed: list[RequestError] = field(default_factory=list)


class TokenizerCore:
    def __init__(self, path: str | Path, chat_template: str | None = None,
                 stop_regex_budget_s: float = CPU_BUDGET_S) -> None:
        """``chat_template``: ``--chat-template``, a Jinja file or a built-in name, in place of the tokenizer's;
        ``stop_regex_budget_s``: the CPU seconds one request's stop_regex matching may take."""
        from transformers import AutoTokenizer

        from radixserve.actors.jinja_templates import load_chat_template

        self.stop_regex_budget_s = stop_regex_budget_s

        # trust_remote_code=False: a tokenizer shipping its own code is refused, never run (nor asked about)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        if chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(chat_template)
        self.vocab_size = len(self.tokenizer)
        self._hidden: dict[int, bool] = {}  # token id -> is it special (``hidden``), as asked

    def chat_template(self) -> dict[str, Any] | None:
        """The role markers of the model's own chat template (None without one), as radixserve.lang uses them.
        A convenience for clients: a template that defeats the derivation is logged, never a reason not to serve."""
        from radixserve.role_markers import ChatTemplate

        try:
            template = ChatTemplate.from_tokenizer(self.tokenizer)
        except Exception:
            log.exception("could not derive role markers from the chat template; /get_model_info reports none")
            return None
        return template.to_dict() if template is not None else None

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"a prompt must be a string, got {type(text).__name__}")
        return self.tokenizer(text).input_ids

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None
                            ) -> list[int]:
        """Render ``messages`` with the model's chat template and encode the result. ``continue_final_message``:
        a last message of the assistant's is its answer so far, to be continued (SGLang's assistant prefill);
        ``tools``: the functions offered (OpenAI's shape), shown as the template shows them (or not at all)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        if self.tokenizer.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead (or start the server "
                             "with --chat-template, e.g. chatml)")
        prefill = ""
        if continue_final_message and messages[-1].get("role") == "assistant":
            # the assistant's turn opened as for a new answer, then its text so far: the template never closes it
            messages, prefill, add_generation_prompt = messages[:-1], messages[-1].get("content") or "", True
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt) + prefill
        # the template already wrote any special tokens it wants; don't add a second BOS
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def text_reply(self, req: TextReq) -> ControlReply:
        """/tokenize and /detokenize; a bad input (a chat the template refuses) is the reply's error."""
        try:
            if req.op == "detokenize":
                return ControlReply(req.reply_id, {"texts": [self.decode(ids, req.skip_special_tokens)
                                                             for ids in req.token_ids]})
            if req.messages is not None:
                tokens = [self.apply_chat_template(req.messages, req.add_generation_prompt, tools=req.tools)]
            else:
                tokens = [self.tokenizer(t, add_special_tokens=req.add_special_tokens).input_ids for t in req.texts]
            return ControlReply(req.reply_id, {"tokens": tokens})
        except Exception as exc:  # as for a prompt: a template or tokenizer error is the input's problem
            return ControlReply(req.reply_id, {}, error=str(exc) or f"could not {req.op} the input "
                                f"({type(exc).__name__})")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def hidden(self, token_id: int) -> bool:
        """Is this a special token (one ``skip_special_tokens`` leaves out of the text)?"""
        if token_id not in self._hidden:
            self._hidden[token_id] = self.decode([token_id]) == "" and self.decode([token_id], False) != ""
        return self._hidden[token_id]

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def token_logprob(self, token_id: int, lp: Logprob | None) -> TokenLogprob:
        """A token's logprob with the texts of it and its alternatives (``lp`` None: the prompt's first token)."""
        if lp is None:
            return TokenLogprob(self.token_text(token_id), token_id, None, [])
        top = [(self.token_text(t), t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]
        return TokenLogprob(self.token_text(token_id), token_id, lp.logprob, top)

    def prompt_logprobs(self, scored: ScoredPrompt) -> list[TokenLogprob]:
        return [self.token_logprob(t, lp) for t, lp in zip(scored.token_ids, scored.logprobs)]

    def prefilled_delta(self, done: Finished) -> Delta:
        """The one delta of a prefill-only request."""
        lps = self.prompt_logprobs(done.prompt_logprobs) if done.prompt_logprobs is not None else None
        return Delta(done.rid, "", [], done.prompt_tokens, 0, done.cached_tokens, done.reason, None, lps,
                     done.cached_tiers)

    def detokenize(self, batch: TokenBatch, live: dict[str, OutputText]) -> Detokenized:
        """One step's TokenBatch for the requests in ``live`` (finished ones leave it). The tokenizer actor and
        the offline Engine both go through here."""
        out = Detokenized()
        for done in batch.prefilled:
            if live.pop(done.rid, None) is not None:
                out.deltas.append(self.prefilled_delta(done))
        prompt, cached = batch.prompt_tokens.tolist(), batch.cached_tokens.tolist()
        for i, (rid, run) in enumerate(zip(batch.rids, batch.runs())):
            text_out = live.get(rid)
            if text_out is None:  # already ended here (stop string, abort); the scheduler heard or will
                continue
            try:
                before = text_out.completion_tokens
                text, finish, stopped_here, cut = text_out.add(run, batch.finished.get(i))
                run = run[: text_out.completion_tokens - before]  # a stop string ends it at its token
                lps = batch.logprobs.get(i)
                logprobs = [self.token_logprob(t, lp) for t, lp in zip(run, lps)] if lps is not None else None
                scored = batch.prompt_logprobs.get(i)
                prompt_lp = self.prompt_logprobs(scored) if scored is not None else None
            except InvalidRequest as exc:  # the request's own doing (a stop_regex over its budget): it alone ends
                live.pop(rid, None)
                out.failed.append(RequestError(rid, str(exc), status=400, param=exc.param))
                continue
            except Exception:
                log.exception("internal error while detokenizing request %s", rid)
                live.pop(rid, None)
                out.failed.append(RequestError(rid, "internal error while detokenizing (logged)", status=500,
                                               code="internal_error"))
                continue
            if stopped_here:
                out.stops.append(FinishReq(rid, finish))
            if finish is not None:
                del live[rid]
            out.deltas.append(Delta(rid, text, run, prompt[i], text_out.completion_tokens, cached[i],
                                    finish, logprobs, prompt_lp, batch.cached_tiers.get(i), batch.drafts.get(i),
                                    cut))
        return out

    def detokenizer(self, params: SamplingParams) -> Detokenizer:
        patterns = params.stop_patterns_source
        regexes = StopRegexes(patterns, self.stop_regex_budget_s) if patterns else None
        return Detokenizer(self, params.skip_special_tokens, params.stop_strings, regexes, params.min_new_tokens)

    def output(self, params: SamplingParams) -> OutputText:
        return OutputText(self.detokenizer(params))


@dataclass
class OutputText:
    """One request's output as text, a token at a time: the text that is final so far, and whether a stop string
    ended the request. The tokenizer actor and the offline Engine both go through ``add``: one rule for stops."""

    detok: Detokenizer
    emitted: int = 0  # characters of text already handed out
    completion_tokens: int = 0

    @property
    def text(self) -> str:
        return self.detok.text

    def add(self, token_ids: list[int], finish: FinishReason | None) -> tuple[str, FinishReason | None, bool, int]:
        """Take the request's new tokens (none: it ended without one) and the scheduler's finish reason, which
        comes with the last of them. With stop strings each token is looked at in turn, and one that ends the
        output leaves the rest untaken (``completion_tokens`` counts what was taken).

        Returns the text that became final since the last call, why the request ended (None: it goes on),
        whether a stop string ended it here -- then the scheduler does not know yet and must be told --, and how
        many characters already handed out the final text drops (``Delta.cut``: a stop_regex match that began in
        them; a stop string's prefix is held back instead).
        """
        # the special token that ended the output (EOS) is no part of its text, even with skip_special_tokens
        # false (SGLang trims it too): a tool-call parser reads the text up to it
        hide = bool(token_ids) and finish is not None and finish.type == "stop" and \
            finish.matched == token_ids[-1] and self.detok.core.hidden(token_ids[-1])
        shown = token_ids[:-1] if hide else token_ids
        stop, taken = None, len(token_ids)
        each = 1 if self.detok.can_stop else max(len(shown), 1)  # without stops: the whole run in one decode
        for at in range(0, len(shown), each):
            stop = self.detok.add(shown[at : at + each])
            if stop is not None:
                taken = min(at + each, len(shown))
                break
        self.completion_tokens += taken
        stopped_here = stop is not None and finish is None
        if stop is not None:  # the stop string wins over an EOS or length ending on the same token
            finish = FinishReason("stop", matched=stop)
        if finish is not None:
            self.detok.flush()
            text = self.detok.text
        else:
            text = self.detok.stable_text
        new, cut = text[self.emitted :], max(0, self.emitted - len(text))
        self.emitted = len(text)
        return new, finish, stopped_here, cut


@dataclass
class Detokenizer:
    """Turns a growing list of token ids into text, a few tokens at a time.

    Decoding a token alone can split a multi-byte character or lose the space a neighbour gives it, so each
    step decodes a short window ending at the new tokens and emits only what became final. ``stable_text`` is
    what can be shown now: it holds back a possible beginning of a stop string.
    """

    core: TokenizerCore
    skip_special_tokens: bool
    stop_strings: list[str]
    stop_regexes: StopRegexes | None = None  # linear-time, and each check looks only where a new match can be
    min_tokens: int = 0  # min_new_tokens: before the output holds this many tokens, no stop string ends it
    ids: list[int] = field(default_factory=list)
    text: str = ""
    stopped_by: str | None = None
    _prefix_offset: int = 0  # window start: decoded for context only
    _read_offset: int = 0  # tokens before this are already in `text`
    _floor: int = 0  # a stop match must end after this (the text written before min_tokens was reached)

    @property
    def can_stop(self) -> bool:
        """Whether anything in the text can end the output (a stop string or a stop_regex)."""
        return bool(self.stop_strings) or self.stop_regexes is not None

    def add(self, new_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears (``text`` is cut before it)."""
        if self.stopped_by is not None:
            return self.stopped_by
        self.ids.extend(new_ids)
        before = len(self.text)
        decode = self.core.decode
        prefix = decode(self.ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full = decode(self.ids[self._prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):  # an incomplete character waits
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        if len(self.ids) < self.min_tokens:
            self._floor = len(self.text)
            return None
        return self._find_stop(before)

    def _find_stop(self, before: int) -> str | None:
        if not self.stop_strings and self.stop_regexes is None:
            return None
        before = max(before, self._floor)
        # a stop string may straddle the old and new text: each is searched where it would end in the new
        hits = [(self.text.find(s, max(0, before - len(s) + 1)), s) for s in self.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if self.stop_regexes is not None and (hit := self.stop_regexes.search(self.text, self._floor)) is not None:
            hits.append(hit)  # the earliest match starting at the floor or later, found only where it can be new
        if not hits:
            return None
        pos, s = min(hits)
        self.text = self.text[:pos]
        self.stopped_by = s
        return s

    def flush(self) -> None:
        """At the end: whatever is still held back (an incomplete character) is decoded as is."""
        if self.stopped_by is None and self._read_offset < len(self.ids):
            prefix = self.core.decode(self.ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
            full = self.core.decode(self.ids[self._prefix_offset :], self.skip_special_tokens)
            self.text += full[len(prefix) :]
            self._read_offset = len(self.ids)
            self._find_stop(0)

    @property
    def stable_text(self) -> str:
        """Text that will not change: all of it once stopped, else minus a possible stop-string prefix."""
        if self.stopped_by is not None or not self.stop_strings:
            return self.text
        hold = 0
        for s in self.stop_strings:
            tail = self.text[len(self.text) - min(len(s) - 1, len(self.text)) :]
            for i in range(len(tail) - hold):  # the longest end of the text that begins the stop string
                if s.startswith(tail[i:]):
                    hold = len(tail) - i
                    break
        return self.text[: len(self.text) - hold]
