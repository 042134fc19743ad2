"""Engine: the offline API. An in-process wiring of the same cores the server runs as actors:
TokenizerCore -> Scheduler -> ModelRunner, stepped in a loop until every request is done."""
from __future__ import annotations

import gc
import itertools
import logging
import threading
from typing import Any

from radixserve.actors.messages import RequestError
from radixserve.actors.scheduler import Req
from radixserve.actors.scheduler.scheduler import build_scheduler
from radixserve.actors.tokenizer import OutputText, TokenizerCore
from radixserve.errors import InvalidRequest
from radixserve.prepare import prepare
from radixserve.prompts import text_or_ids
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

log = logging.getLogger(__name__)

Prompt = str | list[str] | None
TokenIds = list[int] | list[list[int]] | None
Params = SamplingParams | dict[str, Any] | list[SamplingParams | dict[str, Any]] | None


class Engine:
    """``Engine(model_path=None, **server_args)``: server_args are the CLI flags with underscores
    (dtype, max_total_tokens, chunked_prefill_size, max_running_requests, schedule_policy, eviction_policy,
    disable_radix_cache, ...). Without a model path: the bundled SmolLM2-135M-Instruct."""

    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        from radixserve.model.runner import ModelRunner  # torch is paid for here, not at import

        prepared = prepare(ServerArgs.from_kwargs(model_path=model_path, **server_args))
        self.args = args = prepared.args
        self.model_config = prepared.model
        self.model_files = prepared.files
        self.tokenizer = TokenizerCore(prepared.files.path)
        self.runner = ModelRunner.from_args(prepared.model, prepared.files.path, args)
        self.scheduler = build_scheduler(args, prepared.scheduler_config)
        self._ids = itertools.count()
        self._closed = False
        self._lock = threading.RLock()  # calls from several threads run one after another, never interleaved

    # -- public API --------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt = None, sampling_params: Params = None, input_ids: TokenIds = None,
                 return_logprob: bool = False, top_logprobs_num: int = 0, priority: int = 0,
                 ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of prompts (returns a list, same order).

        Give ``prompt`` (text) or ``input_ids`` (token ids), not both. ``sampling_params`` is one dict /
        SamplingParams for all, or a list with one per prompt. Each result has ``text``, ``output_ids`` and
        ``meta_info`` (prompt_tokens, completion_tokens, cached_tokens, finish_reason). ``return_logprob``
        adds ``output_token_logprobs`` [(logprob, token_id)] and, with ``top_logprobs_num`` > 0,
        ``output_top_logprobs`` [[(logprob, token_id), ...]] to meta_info. Bad values raise InvalidRequest (a
        ValueError) naming the field, before anything is queued. A request that fails on our side ends alone,
        with ``meta_info["error"]``; after an exception or Ctrl-C the Engine is ready for the next call.
        """
        self._require_open()
        prompts = text_or_ids(prompt, input_ids, self.model_config.vocab_size, text_param="prompt")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts.items]
        params = self._params_per_prompt(sampling_params, len(ids))
        top_logprobs = top_logprobs_num if return_logprob else None
        with self._lock:
            results = self._run(ids, params, top_logprobs, priority)
        return results[0] if prompts.single else results

    def chat(self, messages: list[dict[str, Any]], sampling_params: Params = None) -> dict[str, Any]:
        """One chat turn: the model's chat template is applied to ``messages``."""
        self._require_open()
        return self.generate(input_ids=self.tokenizer.apply_chat_template(messages), sampling_params=sampling_params)

    def set_policies(self, eviction: str | None = None, schedule: str | None = None) -> dict[str, Any]:
        """Switch the eviction and/or schedule policy by name (built-in or plugin); returns ``policies()``."""
        self._require_open()
        with self._lock:
            self.scheduler.switch_policies(eviction, schedule)
        return self.policies()

    def policies(self) -> dict[str, Any]:
        """``{"eviction": {"current", "available"}, "schedule": {...}, "errors": [...]}``"""
        self._require_open()
        return self.scheduler.policies_info()

    def cache_stats(self) -> dict[str, Any]:
        """Pool state, totals and one record per policy epoch (as GET /cache/stats)."""
        self._require_open()
        return self.scheduler.cache_stats()

    def flush_cache(self) -> int:
        """Drop every cached prefix that no running request holds; returns tokens freed."""
        self._require_open()
        with self._lock:
            return self.scheduler.cache.flush()

    def shutdown(self) -> None:
        """Free the model weights and the KV pool (idempotent); the Engine refuses further calls."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
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
    @staticmethod
    def _params_per_prompt(params: Params, n: int) -> list[SamplingParams]:
        if isinstance(params, list):
            if len(params) != n:
                raise InvalidRequest(f"got {len(params)} sampling_params for {n} prompts; give one or one per "
                                     "prompt", param="sampling_params")
            return [SamplingParams.coerce(p) for p in params]
        one = SamplingParams.coerce(params)
        return [one] * n

    def _run(self, ids: list[list[int]], params: list[SamplingParams], top_logprobs: int | None,
             priority: int) -> list[dict[str, Any]]:
        sched = self.scheduler
        for p, sp in zip(ids, params):  # validate all before queueing any: a bad prompt loses nothing
            sched.validate(p, sp, top_logprobs)
        reqs: list[Req] = []
        outputs: dict[str, OutputText] = {}
        try:
            for p, sp in zip(ids, params):
                req = sched.add_request(f"engine-{next(self._ids)}", p, sp, top_logprobs, priority)
                reqs.append(req)
                outputs[req.rid] = self.tokenizer.output(sp)
            while not all(r.finished for r in reqs):
                plan = sched.schedule()
                if plan is None:
                    if sched.failures:  # requests failed while planning; the rest go on
                        continue
                    raise RuntimeError("the scheduler has unfinished requests but planned nothing (a bug)")
                for req in sched.process(self.runner.forward(plan)):
                    _, finish, stopped_here = outputs[req.rid].add(req.output_ids[-1], req.finish_reason)
                    if stopped_here:
                        sched.finish(req.rid, finish)
        except BaseException:  # an error or Ctrl-C mid-step: give back every slot, keep the Engine usable
            sched.fail_step("interrupted")  # the step being computed never finished: its slots hold nothing
            sched.fail_all("interrupted")
            sched.take_failures()
            raise
        errors = {e.rid: e for e in sched.take_failures()}
        return [self._result(r, outputs[r.rid], errors.get(r.rid)) for r in reqs]

    def _result(self, req: Req, output: OutputText, error: RequestError | None) -> dict[str, Any]:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens or 0,
            "finish_reason": req.finish_reason.to_dict(),
        }
        if req.top_logprobs is not None:
            meta["output_token_logprobs"] = [(lp.logprob, t) for lp, t in zip(req.output_logprobs, req.output_ids)]
            if req.top_logprobs > 0:
                meta["output_top_logprobs"] = [list(zip(lp.top_logprobs, lp.top_ids)) for lp in req.output_logprobs]
        if error is not None:
            meta["error"] = {"message": error.message, "status": error.status, "code": error.code}
        return {"text": output.text, "output_ids": list(req.output_ids), "meta_info": meta}
