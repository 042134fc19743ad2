"""Engine: the offline API. An in-process wiring of the same cores the server runs as actors:
TokenizerCore -> Scheduler -> ModelRunner, stepped in a loop until every request is done."""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

from radixserve.actors.scheduler import FinishReason, Req
from radixserve.actors.scheduler.scheduler import build_scheduler
from radixserve.actors.tokenizer import Detokenizer, TokenizerCore
from radixserve.prepare import prepare
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
        self.runner = ModelRunner(prepared.model, prepared.files.path, dtype=args.dtype,
                                  num_slots=args.max_total_tokens, device=args.device,
                                  attention_backend=args.attention_backend, num_threads=args.num_threads)
        self.scheduler = build_scheduler(args, prepared.scheduler_config)
        self._ids = itertools.count()
        self._closed = False
        self._lock = threading.Lock()  # calls from several threads run one after another, never interleaved

    # -- public API --------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt = None, sampling_params: Params = None, input_ids: TokenIds = None,
                 return_logprob: bool = False, top_logprobs_num: int = 0, priority: int = 0,
                 ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of prompts (returns a list, same order).

        Give ``prompt`` (text) or ``input_ids`` (token ids), not both. ``sampling_params`` is one dict /
        SamplingParams for all, or a list with one per prompt. Each result has ``text``, ``output_ids`` and
        ``meta_info`` (prompt_tokens, completion_tokens, cached_tokens, finish_reason). ``return_logprob``
        adds ``output_token_logprobs`` [(logprob, token_id)] and, with ``top_logprobs_num`` > 0,
        ``output_top_logprobs`` [[(logprob, token_id), ...]] to meta_info.
        """
        if self._closed:
            raise RuntimeError("this Engine was shut down")
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) or input_ids (token ids)")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else prompt
            if not isinstance(prompts, list) or not prompts:
                raise ValueError("prompt must be a string or a non-empty list of strings")
            ids = [self.tokenizer.encode(p) for p in prompts]
        else:
            single = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], int)
            ids = [input_ids] if single else input_ids
            if not isinstance(ids, list) or not ids or not all(isinstance(x, list) for x in ids):
                raise ValueError("input_ids must be a list of token ids or a non-empty list of such lists")
            if not all(isinstance(t, int) and not isinstance(t, bool) for x in ids for t in x):
                raise ValueError("input_ids must contain integers only")
        params = self._params_per_prompt(sampling_params, len(ids))
        if not 0 <= top_logprobs_num <= 20:
            raise ValueError(f"top_logprobs_num={top_logprobs_num} must be in [0, 20]")
        logprobs = top_logprobs_num if return_logprob else -1
        with self._lock:
            results = self._run(ids, params, logprobs, priority)
        return results[0] if single else results

    def chat(self, messages: list[dict[str, Any]], sampling_params: Params = None) -> dict[str, Any]:
        """One chat turn: the model's chat template is applied to ``messages``."""
        return self.generate(input_ids=self.tokenizer.apply_chat_template(messages), sampling_params=sampling_params)

    def set_policies(self, eviction: str | None = None, schedule: str | None = None) -> dict[str, Any]:
        """Switch the eviction and/or schedule policy by name (built-in or plugin); returns ``policies()``."""
        with self._lock:
            self.scheduler.switch_policies(eviction, schedule)
        return self.policies()

    def policies(self) -> dict[str, Any]:
        """``{"eviction": {"current", "available"}, "schedule": {...}, "errors": [...]}``"""
        return self.scheduler.policies_info()

    def cache_stats(self) -> dict[str, Any]:
        """Pool state, totals and one record per policy epoch (as GET /cache/stats)."""
        return self.scheduler.cache_stats()

    def flush_cache(self) -> int:
        """Drop every cached prefix that no running request holds; returns tokens freed."""
        return self.scheduler.cache.flush()

    def shutdown(self) -> None:
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the loop ----------------------------------------------------------------------------------------
    @staticmethod
    def _params_per_prompt(params: Params, n: int) -> list[SamplingParams]:
        if isinstance(params, list):
            if len(params) != n:
                raise ValueError(f"got {len(params)} sampling_params for {n} prompts; give one or one per prompt")
            return [SamplingParams.coerce(p) for p in params]
        one = SamplingParams.coerce(params)
        return [one] * n

    def _run(self, ids: list[list[int]], params: list[SamplingParams], logprobs: int,
             priority: int) -> list[dict[str, Any]]:
        sched = self.scheduler
        for p, sp in zip(ids, params):  # validate all before queueing any: a bad prompt loses nothing
            sched.validate(p, sp)
        reqs: list[Req] = []
        detoks: dict[str, Detokenizer] = {}
        for p, sp in zip(ids, params):
            req = sched.add_request(f"engine-{next(self._ids)}", p, sp, logprobs, priority)
            reqs.append(req)
            detoks[req.rid] = self.tokenizer.detokenizer(sp)
        while not all(r.finished for r in reqs):
            plan = sched.schedule()
            if plan is None:
                raise RuntimeError("the scheduler has unfinished requests but planned nothing (a bug)")
            for req in sched.process(self.runner.forward(plan)):
                detok = detoks.get(req.rid)
                if detok is None:
                    continue
                stop = detok.add(req.output_ids[-1:])
                if stop is not None and not req.finished:
                    sched.finish(req.rid, FinishReason("stop", matched=stop))
        return [self._result(r, detoks[r.rid]) for r in reqs]

    def _result(self, req: Req, detok: Detokenizer) -> dict[str, Any]:
        detok.flush()
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens or 0,
            "finish_reason": req.finish_reason.to_dict(),
        }
        if req.logprobs >= 0:
            meta["output_token_logprobs"] = [(lp, t) for (lp, _), t in zip(req.output_logprobs, req.output_ids)]
            if req.logprobs > 0:
                meta["output_top_logprobs"] = [[(lp, t) for t, lp in top] for _, top in req.output_logprobs]
        return {"text": detok.text, "output_ids": list(req.output_ids), "meta_info": meta}
