"""Engine: the offline API. An in-process wiring of the same cores the server runs as actors:
TokenizerCore -> Scheduler -> ModelRunner, stepped in a loop until every request is done."""
from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from radixserve.actors.api.protocol import GenerateBody
from radixserve.actors.api.sglang_generate import (
    LogprobOptions, GenerateBatch, GenerateOutput, generate_batch, sequences, with_processors
)
from radixserve.actors.scheduler import build_scheduler
from radixserve.actors.scheduler.actor import take_tokens
from radixserve.actors.tokenizer import OutputText, TokenizerCore, output_interval
from radixserve.errors import InvalidRequest
from radixserve.prepare import prepare
from radixserve.prompts import text_or_ids
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from radixserve.wire.messages import Delta, FinishReason, GenerateReq

log = logging.getLogger(__name__)

Prompt = str | list[str] | None
TokenIds = list[int] | list[list[int]] | None
Params = SamplingParams | dict[str, Any] | list[SamplingParams | dict[str, Any]] | None


class Engine:
    """``Engine(model_path=None, **server_args)``: server_args are the CLI flags with underscores
    (dtype, max_total_tokens, chunked_prefill_size, max_running_requests, schedule_policy, eviction_policy,
    disable_radix_cache, ...). Without a model path: the bundled SmolLM2-135M-Instruct."""

    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        from radixserve.actors.runner_actor import seed_sampling
        from radixserve.model.runner import ModelRunner  # torch is paid for here, not at import

        args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        if args.dp > 1:
            raise ValueError("Engine runs one replica; --dp replicas behind a router are the server's "
                             "(`radixserve serve --dp N`)")
        if args.nnodes > 1:
            raise ValueError("Engine runs on one machine (tp ranks as local processes); across machines, start "
                             "`radixserve serve --nnodes N --node-rank K ...` on each")
        self.prepared = prepared = prepare(args)
        self.args = args = prepared.args
        self.model_config = prepared.model
        self.model_files = prepared.files
        self.tokenizer = TokenizerCore(prepared.tokenizer_dir, args.chat_template)
        if args.tp > 1:  # the ranks as processes (the server's runner actors), this scheduler publishing to them
            from radixserve.actors.ranks import Ranks

            self.runner = Ranks(prepared)
        else:
            self.runner = ModelRunner.from_args(prepared.model, prepared.files.path, args, prepared.files.source)
            seed_sampling(args.random_seed)  # the ranks' processes seed their own
        self.scheduler = build_scheduler(args, prepared.scheduler_config)
        self._tier_answers: queue.SimpleQueue = queue.SimpleQueue()  # read-backs the runner's tiers answered
        if prepared.scheduler_config.tiers is not None:
            self.runner.attach_tiers(args, prepared.scheduler_config.tiers, self._tier_answers.put)
        self._ids = itertools.count()
        self._closed = False
        self._lock = threading.RLock()  # one step at a time; any caller may run it (see _drive)
        self._live: dict[str, OutputText] = {}  # rid -> its text so far, as the tokenizer actor keeps it
        self._sinks: dict[str, _Sink] = {}  # rid -> where its results go
        self._model_info: dict[str, Any] | None = None

    # -- public API --------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt = None, sampling_params: Params = None, input_ids: TokenIds = None,
                 return_logprob: bool = False, logprob_start_len: int | None = None, top_logprobs_num: int = 0,
                 return_text_in_logprobs: bool = False, priority: int | None = None, stream: bool = False,
                 custom_logit_processor: str | list[str | None] | None = None,
                 ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of prompts (returns a list, same order).

        Give ``prompt`` (text) or ``input_ids`` (token ids), not both. ``sampling_params`` is one dict /
        SamplingParams for all, or a list with one per prompt. Each result is SGLang's: ``text``, ``output_ids``
        and ``meta_info`` (prompt_tokens, completion_tokens, cached_tokens, finish_reason). ``max_new_tokens``
        0 computes and caches the prompt only. ``return_logprob`` adds ``output_token_logprobs`` as
        [logprob, token_id, text] triples (text with ``return_text_in_logprobs``), the prompt's from
        ``logprob_start_len`` on as ``input_token_logprobs``, and with ``top_logprobs_num`` > 0 the top
        alternatives. ``stream=True`` returns an iterator of results so far (cumulative text, ``index``: which
        prompt). Bad values raise InvalidRequest (a ValueError) naming the field, before anything is queued. A
        request that fails on our side ends alone, with ``meta_info["error"]``. Calls from several threads are
        batched together; after an exception or Ctrl-C the Engine is ready for the next call.
        ``priority``: with ``enable_priority_scheduling``, as a server's (None: the default).
        ``custom_logit_processor``: the name of a processor this Engine enables (``logit_processors=[...]``), for
        every prompt or one per prompt; its parameters are the sampling params' ``custom_params``.
        """
        self._require_open()
        prompts = text_or_ids(prompt, input_ids, self.model_config.vocab_size, text_param="prompt")
        params = with_processors(self._params_per_prompt(sampling_params, len(prompts.items)), custom_logit_processor)
        start = None if logprob_start_len is None or logprob_start_len < 0 else logprob_start_len
        logprobs = LogprobOptions(top_logprobs_num, return_text_in_logprobs, start) if return_logprob else None
        _, gens, single = sequences(prompts, params, f"engine-{next(self._ids)}", logprobs, priority)
        return self._answer(gens, logprobs, single, stream)

    def sglang_generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's ``POST /generate`` body in, its response out (``stream`` in the payload is ignored)."""
        batch = self._sglang_batch(payload)
        return self._answer(batch.gens, batch.logprobs, batch.single, stream=False)

    def sglang_generate_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """SGLang's streaming ``/generate``: results so far (cumulative text) with ``index``, as the server's
        events."""
        batch = self._sglang_batch(payload)
        return self._answer(batch.gens, batch.logprobs, batch.single, stream=True)

    def model_info(self) -> dict[str, Any]:
        """What ``GET /get_model_info`` answers (model path, the chat template's role markers, ...)."""
        if self._model_info is None:
            with self._lock:
                self._model_info = self.prepared.model_info(self.tokenizer.chat_template())
        return self._model_info

    def chat(self, messages: list[dict[str, Any]], sampling_params: Params = None) -> dict[str, Any]:
        """One chat turn: the model's chat template is applied to ``messages``."""
        self._require_open()
        with self._lock:  # the tokenizer is used by the steps too
            ids = self.tokenizer.apply_chat_template(messages)
        return self.generate(input_ids=ids, sampling_params=sampling_params)

    def set_policies(self, eviction: str | None = None, schedule: str | None = None, write: str | None = None,
                     prefetch: str | None = None, draft: str | None = None) -> dict[str, Any]:
        """Switch the eviction, schedule, (with KV tiers) write and prefetch, and (with speculative decoding)
        draft policies by name (built-in or plugin); returns ``policies()``."""
        self._require_open()
        with self._lock:
            self.scheduler.policies.switch(eviction, schedule, write=write, prefetch=prefetch, draft=draft)
        return self.policies()

    def policies(self) -> dict[str, Any]:
        """``{"eviction": {"current", "available"}, "schedule": {...}, "errors": [...]}``"""
        self._require_open()
        return self.scheduler.policies.info()

    def cache_stats(self) -> dict[str, Any]:
        """Pool state, totals and one record per policy epoch (as GET /cache/stats)."""
        self._require_open()
        return self.scheduler.policies.cache_stats()

    def flush_cache(self, keep_storage: bool = False) -> int:
        """Drop every cached prefix that no running request holds, from the pool and the lower KV tiers (storage
        too unless ``keep_storage``); returns tokens freed from the pool."""
        self._require_open()
        with self._lock:
            freed = self.scheduler.flush(keep_storage)["tokens_freed"]
            self._exchange_tiers()
            return freed

    def shutdown(self) -> None:
        """Free the model weights and the KV pool (idempotent); the Engine refuses further calls."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if hasattr(self.runner, "shutdown"):  # the tensor-parallel ranks' processes
                self.runner.shutdown()
            self.runner = self.scheduler = None  # the last references to the weights and the pool tensors
        gc.collect()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine was shut down; create a new one")

    # -- the loop ----------------------------------------------------------------------------------------
    # Every call queues its requests and then drives the shared loop: whichever caller holds the lock runs the
    # next step for all requests in flight (its own and other threads'), and each picks up its own deltas.
    @staticmethod
    def _params_per_prompt(params: Params, n: int) -> list[SamplingParams]:
        if isinstance(params, list):
            if len(params) != n:
                raise InvalidRequest(f"got {len(params)} sampling_params for {n} prompts; give one or one per "
                                     "prompt", param="sampling_params")
            return [SamplingParams.coerce(p) for p in params]
        one = SamplingParams.coerce(params)
        return [one] * n

    def _sglang_batch(self, payload: dict[str, Any]) -> GenerateBatch:
        self._require_open()
        if not isinstance(payload, dict):
            raise InvalidRequest("the payload must be a dict: SGLang's /generate body", param="payload")
        try:
            body = msgspec.convert(payload, GenerateBody)
        except msgspec.ValidationError as exc:
            if isinstance(exc.__cause__, InvalidRequest):
                raise exc.__cause__ from None
            raise InvalidRequest(f"invalid /generate payload: {exc}", param="payload") from None
        return generate_batch(body, self.model_config.vocab_size)

    def _answer(self, gens: list[GenerateReq], logprobs: LogprobOptions | None, single: bool, stream: bool):
        outputs = self._submit(gens, logprobs, stream)
        if stream:
            return self._stream(outputs)
        for _ in self._drive(outputs):
            pass
        bodies = [o.result() for o in outputs]
        return bodies[0] if single else bodies

    def _stream(self, outputs: list[_Sink]) -> Iterator[dict[str, Any]]:
        for i in self._drive(outputs):
            yield {**outputs[i].result(), "index": i}

    def _submit(self, gens: list[GenerateReq], logprobs: LogprobOptions | None, stream: bool) -> list[_Sink]:
        with self._lock:  # the tokenizer too: HF's fast tokenizer may not encode while another thread decodes
            self._require_open()
            ids = [self.tokenizer.encode(g.text) if g.text is not None else g.input_ids for g in gens]
            sched = self.scheduler
            for p, g in zip(ids, gens):  # validate all before queueing any: a bad prompt loses nothing
                sched.validate(p, g.params, g.top_logprobs, g.logprob_start)
            sinks = []
            for p, g in zip(ids, gens):
                sched.add_request(g.rid, p, g.params, g.top_logprobs, g.priority, g.logprob_start,
                                  output_interval=output_interval(g.params, stream))
                sink = _Sink(GenerateOutput(g.rid, logprobs))
                self._live[g.rid] = self.tokenizer.output(g.params)
                self._sinks[g.rid] = sink
                sinks.append(sink)
        return sinks

    def _drive(self, sinks: list[_Sink]) -> Iterator[int]:
        """Run steps until every one of ``sinks`` is done, yielding the index of each that got something new."""
        try:
            while True:
                with self._lock:
                    fresh = [i for i, s in enumerate(sinks) if s.take_news()]
                    if not fresh and all(s.done for s in sinks):
                        return
                    if not fresh:
                        self._step_keeping_threads()
                        fresh = [i for i, s in enumerate(sinks) if s.take_news()]
                yield from fresh
        except BaseException:  # an error, Ctrl-C, or a stream the caller dropped: give back what these hold
            with self._lock:
                for s in sinks:
                    if not s.done and self.scheduler is not None:
                        self.scheduler.finish(s.output.rid, FinishReason("abort", message="interrupted"))
                        self._end(s.output.rid)
            raise

    def _exchange_tiers(self, wait: bool = False) -> None:
        """The scheduler's read-back requests to the runner's tiers, and their answers back (``wait``: for one
        answer, briefly: a request is held for it and nothing else can run)."""
        sched = self.scheduler
        if sched.cache.tiers is None:
            return
        for msg in sched.cache.tiers.take_outbox():
            self.runner.tiers.prefetch(msg)
        try:
            if wait:
                sched.prefetched(self._tier_answers.get(timeout=0.02))
            while True:
                sched.prefetched(self._tier_answers.get_nowait())
        except queue.Empty:
            pass

    def _step_keeping_threads(self) -> None:
        """A step in the caller's thread, which keeps its own torch thread count: the runner sets the step's
        (fewer while other processes keep CPUs busy, model/step_threads.py) and this puts the caller's back."""
        import torch

        threads = torch.get_num_threads()
        try:
            self._step()
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def _step(self) -> None:
        sched = self.scheduler
        try:
            self._exchange_tiers()
            plan = sched.schedule()
            updated = self._run_plan(plan) if plan is not None else []
            if plan is None and sched.held:
                self._exchange_tiers(wait=True)
            elif plan is None and not sched.failures:
                raise RuntimeError("the scheduler has unfinished requests but planned nothing (a bug)")
            batch = take_tokens(updated)
            outs = [self.tokenizer.detokenize(batch, self._live)] if batch is not None else []
        except BaseException:  # an error or Ctrl-C mid-step: give back every slot, keep the Engine usable
            sched.fail_step("interrupted")  # the step being computed never finished: its slots hold nothing
            sched.fail_all("interrupted")
            self._deliver_failures()
            raise
        for out in outs:
            for stop in out.stops:
                sched.finish(stop.rid, stop.reason)
            for err in out.failed:
                sched.finish(err.rid, FinishReason("abort", message=err.message))
                self._fail(err.rid, err.message, err.status, err.code)
            for delta in out.deltas:
                sink = self._sinks.get(delta.rid)
                if sink is not None:
                    sink.add(delta)
                    if delta.finish is not None:
                        self._end(delta.rid)
        self._deliver_failures()

    def _run_plan(self, plan) -> list:
        """Run ``plan`` and apply its result; speculative decoding's cost gate gets the step's duration."""
        start = time.perf_counter()
        result = self.runner.forward(plan)
        seconds = time.perf_counter() - start
        updated = self.scheduler.process(result)
        if result is not None and result.error is None:
            self.scheduler.spec.timed(plan.mode, plan.drafts, plan.batch_size, seconds)
        return updated

    def _deliver_failures(self) -> None:
        for err in self.scheduler.take_failures():
            self._fail(err.rid, err.message, err.status, err.code)

    def _fail(self, rid: str, message: str, status: int, code: str | None) -> None:
        sink = self._sinks.get(rid)
        if sink is not None:
            sink.fail({"message": message, "status": status, "code": code})
        self._end(rid)

    def _end(self, rid: str) -> None:
        self._sinks.pop(rid, None)
        self._live.pop(rid, None)


class _Sink:
    """One request's results as they arrive, for the thread that asked."""

    def __init__(self, output: GenerateOutput) -> None:
        self.output = output
        self.error: dict[str, Any] | None = None
        self.news = False

    @property
    def done(self) -> bool:
        return self.output.done or self.error is not None

    def add(self, delta: Delta) -> None:
        self.output.add(delta)
        self.news = True

    def fail(self, error: dict[str, Any]) -> None:
        self.error, self.news = error, True

    def take_news(self) -> bool:
        news, self.news = self.news, False
        return news

    def result(self) -> dict[str, Any]:
        if self.output.last is None:  # failed before a token: an empty result that says why
            self.output.add(Delta(self.output.rid, "", [], 0, 0, 0, FinishReason("abort", message="failed")))
        body = self.output.body()
        if self.error is not None:
            body["meta_info"]["error"] = self.error
        return body
