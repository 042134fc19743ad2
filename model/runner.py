"""ModelRunner: owns the weights and the KV pool tensors, runs one ForwardPlan, samples, replies.

It never allocates slots: the scheduler owns the indices, the runner owns the tensors.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from radixserve.kernels import get_backend
from radixserve.kernels.cpu_linear import pack_linears
from radixserve.kernels.cpu_native import NativeUnavailable, default_cache_dir
from radixserve.kernels.cpu_quant import tune_kernel_rows
from radixserve.kernels.vector_math import settle_vector_math
from radixserve.model import process_memory
from radixserve.model.causal_lm import CausalLM
from radixserve.model.compiled import CompiledDecode
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch, KVPool, RopeTable
from radixserve.model.grammar import Constraints, Masks
from radixserve.model.kv_codes import KV_CODES, DecodedReads
from radixserve.model.logit_processing import LogitProcessing
from radixserve.model.native_decode import NativeDecode
from radixserve.model.parallel import SINGLE, TPGroup, read_part, shard_of
from radixserve.model.penalties import Penalties
from radixserve.model.sampler import SamplingInputs, prompt_logprobs_of, sample_rows, verify_tree
from radixserve.model.slot_table import SlotTable
from radixserve.model.step_threads import StepThreads
from radixserve.trusted_cache import cache_root
from radixserve.wire.plans import ForwardPlan, ForwardResult

if TYPE_CHECKING:
    from radixserve.kernels.cpu_quant import QuantLinear

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def iter_safetensors(path: Path, part=lambda name: None, keep=lambda name: True):
    """(name, tensor) of every checkpoint weight ``keep(name)`` wants; ``part(name)``: the (dim, start, length) of
    it to read (only those bytes are read: a tensor-parallel rank never holds the whole model), None for all of it."""
    files = sorted(path.glob("*.safetensors"))
    for file in tqdm(files, desc="loading weights", disable=len(files) < 2):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if keep(name):
                    yield name, read_part(f.get_slice(name), part(name))


def build_model(cfg: ModelConfig, path: Path, dtype: torch.dtype, device: torch.device,
                quantization: str | None = None, source: Path | None = None, tp: TPGroup = SINGLE) -> CausalLM:
    """The model (this rank's share of it) with its weights as loaded (quantized if asked); the runner then
    swaps in the CPU's packed linears (pack_linears)."""
    with torch.device("meta"):
        model = CausalLM(cfg, tp)
    # no random init: every weight is loaded next, but those of the layers a GGUF file's blocks replace, whose
    # memory is never touched (so never resident: a Q4_K_M file is served without a bf16 copy of its linears)
    model = model.to(dtype).to_empty(device=device)
    shipped = file_layers(cfg, quantization, dtype, device, source, path)

    def wanted(name: str) -> bool:
        return not (name.endswith(".weight") and model.module_of(name) in shipped)

    model.load_weights(iter_safetensors(path, lambda name: shard_of(cfg, tp, name), wanted), built=shipped)
    if quantization is not None:
        quantize(model, quantization, dtype, shipped)
    return model.eval()


def file_layers(cfg: ModelConfig, quantization: str | None, dtype: torch.dtype, device: torch.device,
                source: Path | None, folder: Path | None = None) -> dict[str, QuantLinear]:
    """The quantized layers a GGUF source's blocks give as they ship, where their format fits ``quantization``
    (model/gguf_quant.py's AS_SHIPPED), by module name; empty without quantization or a GGUF source. ``folder``:
    the source's conversion (the checkpoint the rest loads from)."""
    if quantization is None:
        return {}
    if device.type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on the CPU only (torch's packed CPU kernels)")
    from_gguf = source is not None and source.suffix == ".gguf"
    if quantization == "gguf" and not from_gguf:
        raise ValueError("--quantization gguf serves a .gguf file's own blocks; this model is not a GGUF file: use "
                         "int8 or int4 to quantize it")
    if not from_gguf:
        return {}
    from radixserve.model.gguf_quant import gguf_quant_linears

    layers = gguf_quant_linears(source, cfg, dtype, quantization, folder)
    log.info("%s: %d linear layers taken from %s as they ship", quantization, len(layers), source.name)
    return layers


def quantize(model: CausalLM, quantization: str, dtype: torch.dtype, shipped: dict[str, QuantLinear]) -> None:
    """Weight-only quantized linear layers (CPU): ``shipped`` (file_layers) where given; under ``gguf`` every other
    layer stays as the file has it, under int8 / int4 it is quantized, and the output projection is 8-bit either
    way (the most sensitive layer: llama.cpp's Q4 files keep it at 6-8 bits, the bundled one at Q8_0)."""
    from radixserve.kernels.cpu_quant import quantize_linear, quantize_model

    layers = dict(shipped)
    if quantization != "gguf" and "lm_head" not in layers:
        layers["lm_head"] = quantize_linear(model.lm_head, 8, dtype)
    bits = {"int8": 8, "int4": 4, "gguf": None}[quantization]
    swapped = quantize_model(model, bits, dtype, layers)
    log.info("%s: %d linear layers quantized", quantization, swapped)


def verify_drafts(logits: torch.Tensor, plan: ForwardPlan,
                  sampling: SamplingInputs) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Speculative decoding: each drafted request's check (sampler.verify_tree) over the model's distributions
    after its last token and after each draft token (the draft rows after the sampling and prompt rows,
    ForwardBatch.logit_rows, then the sampling row, which follows the draft's last token). Drafts go only with
    requests that nothing adjusts (no grammar, penalty or processor), so the check chooses each token as a plain
    step would. Returns (batch index -> the tokens of the draft's path the check walked, sampling row -> the token
    after it, which replaces what that row drew)."""
    first = len(plan.sampling.temperature) + sum(len(w.targets) for w in plan.prompt_logprobs.values())
    parents = plan.draft_parents.tolist() if plan.draft_parents is not None else None
    row = np.cumsum(plan.sample) - 1  # batch index -> its sampling row
    ends = np.cumsum(plan.extend_lens)  # a request's draft is the end of its input tokens
    out, finals, at = {}, {}, 0
    for i, d in enumerate(plan.drafts.tolist()):
        if not d:
            continue
        j = int(row[i])
        draft = plan.input_ids[ends[i] - d : ends[i]].tolist()
        mine = parents[at : at + d] if parents is not None else list(range(-1, d - 1))  # None: chains
        rows = torch.cat([logits[first + at : first + at + d], logits[j : j + 1]])
        *out[i], finals[j] = verify_tree(rows, draft, mine, sampling, j)
        at += d
    return out, finals


class ModelRunner:
    def __init__(self, cfg: ModelConfig, path: Path, *, dtype: str, num_slots: int, device: str = "cpu",
                 attention_backend: str = "auto", num_threads: int | None = None, deterministic: bool = False,
                 quantization: str | None = None, source: Path | None = None, decode_kernel: str = "eager",
                 max_batch: int = 1, tp: TPGroup = SINGLE, context_length: int | None = None,
                 decode_fallback: tuple[str, ...] = (), max_threads: int | None = None,
                 server_root: int | None = None, logit_processors: tuple[str, ...] = (),
                 kv_cache_dtype: str | None = None) -> None:
        """``num_threads``: a fixed thread count (CPU); without it the runner takes up to ``max_threads`` (default:
        this process's CPU budget), fewer while other processes keep CPUs busy (model/step_threads.py).
        ``context_length``: the longest sequence this server admits (default: the model's); LongRoPE models
        choose their factor set from it (ModelConfig.rope_inv_freq). ``decode_fallback``: the decode kernels to
        try in turn when ``decode_kernel`` cannot load here (empty: that fails the start). ``server_root``: the pid
        of the server's launcher, whose processes count as this runner's own when it watches the CPUs (None: this
        process only, as in an Engine). ``logit_processors``: the named processors requests may use (loaded
        now). ``kv_cache_dtype``: int8, fp8_e4m3 or fp8_e5m2 holds the KV pool in 8-bit codes (model/kv_codes.py);
        anything else, the model's dtype."""
        settle_vector_math()  # before any other torch math in this process (kernels/vector_math.py)
        self.threads: StepThreads | None = None  # CPU: the threads every step runs on
        if device == "cpu":  # default: the CPUs this process may use (affinity and cgroup quota) others leave free
            self.threads = StepThreads(num_threads, max_threads, not deterministic, server_root)
        elif deterministic:
            raise ValueError("--deterministic is implemented for the CPU only; run without it on CUDA")
        self.cfg = cfg
        self.tp = tp
        self._sampled: tuple[int, list[int | None]] | None = None  # the last step's tokens (ForwardPlan.filled)
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        start = time.perf_counter()
        self.model = build_model(cfg, path, self.dtype, self.device, quantization, source, tp)
        attn = self.model.model.layers[0].self_attn  # this rank's heads
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        codes = kv_cache_dtype if kv_cache_dtype in KV_CODES else None
        self.kv = KVPool(cfg.num_layers, num_slots + 1, self.num_kv_heads, cfg.head_dim, self.dtype, self.device,
                         codes)
        self.native: NativeDecode | None = None
        self.compiled: CompiledDecode | None = None
        self.decode_refused: dict[str, str] = {}  # kernel -> why it did not load (auto then took the next one)
        kernels = [decode_kernel, *decode_fallback]
        self.native_build_seconds = 0.0  # building (first start) or loading the native step
        if kernels[0] == "native":  # packs its own copy of the weights, from the plain ones: before pack_linears
            native_start = time.perf_counter()
            try:
                self.native = NativeDecode(self.model, self.kv, self.dtype, default_cache_dir())
            except NativeUnavailable as exc:
                self._refused(kernels, exc, "start with --decode-kernel compiled or eager")
            self.native_build_seconds = time.perf_counter() - native_start
            if self.native is not None:
                log.info("native decode step ready in %.1fs (%s)", self.native_build_seconds,
                         "AMX tiles" if self.native.amx else self.native.isa)
        if quantization is not None:  # the layers the native step does not multiply: where torch's kernel pays
            tune_kernel_rows(self.model)
        process_memory.trim()  # the load's freed temporaries (and copies handed to the native step) back to the system
        if not deterministic and (done := pack_linears(self.model)):  # CPU bf16/fp16: faster products
            log.info("CPU linears: %s", done)  # (--deterministic computes every linear layer itself, below)
        positions = cfg.max_position_embeddings
        self.rope = RopeTable(*cfg.rope_inv_freq(context=context_length), positions, self.dtype, self.device)
        self.local_rope = (RopeTable(*cfg.rope_inv_freq(local=True, context=context_length), positions, self.dtype,
                                     self.device) if any(cfg.arch.local_rope) else None)
        self.attn = get_backend(attention_backend, self.device, deterministic)
        if deterministic:
            from radixserve.model.determinism import make_invariant

            make_invariant(self.model, self.attn.ops)
            log.info("deterministic: batch-invariant kernels (%s)", self.attn.ops.name)
        if codes is not None and self.attn.name != "torch":  # the torch backend reads the codes itself
            self.attn = DecodedReads(self.attn)
        self.table = SlotTable()
        self.constraints = Constraints(path, cfg.vocab_size)
        self.penalties = Penalties(cfg.vocab_size, self.device)
        self.processing = LogitProcessing(logit_processors)
        self.tiers = None  # --enable-hierarchical-cache: pages below the pool (attach_tiers)
        log.info("model loaded in %.1fs (%s, %s%s); KV pool %d tokens, %.0f MiB%s", time.perf_counter() - start,
                 cfg.model_type, dtype, f", rank {tp.rank} of {tp.size}" if tp.size > 1 else "", num_slots,
                 self.kv.nbytes / 2**20, f" ({codes} codes, a scale per token and head)" if codes else "")
        if kernels[0] == "compiled":
            try:
                self.compiled = CompiledDecode(self.model, self.kv, self.rope, cache_root() / "inductor",
                                               self.local_rope)
                seconds = self.compiled.warm_up(self.attn, self.dtype, self.device, self._group, max_batch)
                log.info("decode compiled in %.1fs (a layer per graph; cached in %s)", seconds,
                         os.environ["TORCHINDUCTOR_CACHE_DIR"])
            except Exception as exc:  # torch.compile fails in many ways (no compiler, an inductor bug)
                self.compiled = None
                self._refused(kernels, exc, "start with --decode-kernel eager")
            if self.compiled is not None and self.threads is not None:
                # dynamo guards every graph on the thread count it was compiled at: another count would miss them
                self.threads.fix("the compiled decode's graphs are compiled for that count")
        if deterministic:
            from radixserve.model.determinism import check_batch_invariance

            start = time.perf_counter()
            check_batch_invariance(self.logits, cfg.vocab_size, num_slots)
            log.info("deterministic: batch invariance checked on this machine in %.1fs", time.perf_counter() - start)

    def _refused(self, kernels: list[str], exc: Exception, advice: str) -> None:
        """``kernels[0]`` cannot load: the next one serves (logged with the reason), or, with none left (the
        kernel was asked for by name), the start fails."""
        if len(kernels) == 1:
            raise RuntimeError(f"the {kernels[0]} decode kernel cannot run here ({exc}); {advice}") from exc
        self.decode_refused[kernels[0]] = f"{type(exc).__name__}: {exc}"
        log.warning("the %s decode kernel cannot run here (%s); serving with %s instead", kernels[0], exc, kernels[1])
        kernels.pop(0)

    @classmethod
    def from_args(cls, cfg: ModelConfig, path: Path, args, source: Path | None = None,
                  tp: TPGroup = SINGLE, max_threads: int | None = None,
                  server_root: int | None = None) -> ModelRunner:
        """The runner a server or Engine runs, configured by ``args`` (resolved ServerArgs); ``source``: the file
        the user gave (a GGUF file's quantized weights can be used as they ship); ``tp``: this rank's place;
        ``max_threads``: this rank's share of the CPUs (without --num-threads); ``server_root``: the server's
        launcher (see __init__)."""
        return cls(cfg, path, dtype=args.dtype, num_slots=args.max_total_tokens, device=args.device,
                   attention_backend=args.attention_backend, num_threads=args.num_threads,
                   deterministic=args.deterministic, quantization=args.quantization, source=source,
                   decode_kernel=args.decode_kernel, max_batch=args.max_running_requests, tp=tp,
                   context_length=args.context_length, decode_fallback=args.decode_fallback,
                   max_threads=max_threads, server_root=server_root,
                   logit_processors=args.logit_processors or (), kv_cache_dtype=args.kv_cache_dtype)

    def attach_tiers(self, args, config, report) -> None:
        """Pages below the pool (model/kv_tiers.py): ``args`` resolved ServerArgs, ``config`` the scheduler's
        TierConfig, ``report`` called (from a background thread) with each read-back's answer."""
        from radixserve.model.kv_tiers import build_tiers

        self.tiers = build_tiers(self.kv, self.cfg.num_layers, self.num_kv_heads, self.cfg.head_dim, self.dtype,
                                 args, config, report)

    @torch.inference_mode()
    def logits(self, plan: ForwardPlan) -> torch.Tensor:
        """The next-token logits of the plan's sampling rows, then of its prompt-logprob rows (no sampling)."""
        return self._run(self._batch(plan))

    @property
    def _group(self) -> int:
        return self.num_heads // self.num_kv_heads  # query heads per KV head, on this rank

    @property
    def decode_kernel(self) -> str:
        return "native" if self.native is not None else "compiled" if self.compiled is not None else "eager"

    def _batch(self, plan: ForwardPlan) -> ForwardBatch:
        return ForwardBatch.from_plan(plan, self.kv, self.rope, self.attn, self.dtype, self.device, self._group,
                                      self.table, prepare_attention=False, local_rope=self.local_rope,
                                      windows=self.cfg.arch.sliding_windows)

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        if self.native is not None and self.native.applies(batch):
            return self.native(batch)
        batch.prepare_attention()  # only here: the native step reads the slots directly
        if self.compiled is not None and self.compiled.applies(batch):
            return self.compiled(batch)
        return self.model(batch)

    def forward(self, plan: ForwardPlan) -> ForwardResult | None:
        """Run one step. Nothing in it ends the runner: a step that raises comes back as ``error`` (the scheduler
        fails its requests and frees what they allocated), a request whose sampling raises as ``errors[row]``.
        A rank other than 0 computes its share of the step and returns None: rank 0 samples and answers."""
        result = self._forward(plan)
        # overlap: the step planned to follow this one takes its input tokens from here (ForwardPlan.follows)
        self._sampled = (plan.step, result.next_ids) if result is not None and result.error is None else None
        return result

    @torch.inference_mode()
    def _forward(self, plan: ForwardPlan) -> ForwardResult | None:
        if self.threads is not None:
            self.threads.apply()
        if not self.tp.samples:
            return self._share(plan)
        start_errors = self.constraints.update(plan.new_grammars, plan.released)  # even if the step fails
        self.penalties.update(plan.new_penalties, plan.released)
        self.processing.update(plan.new_processors, plan.released)
        try:
            plan = plan.filled(self._sampled)  # overlap: a step planned before the one before it returned
            if plan.tiers is not None and self.tiers is not None:  # pages out and back in, before the forward
                self.tiers.apply(plan.tiers)
            batch = self._batch(plan)
            sampling = SamplingInputs.from_batch(plan.sampling, self.device)
        except Exception as exc:
            log.exception("step %d failed", plan.step)
            return ForwardResult(step=plan.step, error=f"{type(exc).__name__}: {exc}")
        rows = plan.sampling.constraints
        masks = self.constraints.fill_async(rows, sampling.output_index) if rows else None  # during the forward
        try:
            logits = self._run(batch)  # [S + P + D, vocab]: the rows that sample, prompt rows asked for, drafts
            prompt = prompt_logprobs_of(logits[len(sampling):], plan.prompt_logprobs) if plan.prompt_logprobs else {}
            drafted, finals = verify_drafts(logits, plan, sampling) if plan.drafts is not None else ({}, {})
        except Exception as exc:
            self._end_if_parallel(plan)
            log.exception("step %d failed", plan.step)
            if masks is not None:
                masks.result()  # the helper thread is done with the matchers before anything else uses them
            return ForwardResult(step=plan.step, error=f"{type(exc).__name__}: {exc}")
        if len(sampling) == 0:
            return ForwardResult(step=plan.step, prompt_logprobs=prompt)
        raw = logits[: len(sampling)]
        penalized, processed = plan.sampling.penalized, plan.sampling.processed
        if not rows and not penalized and not processed:
            next_ids, logprobs, errors = sample_rows(raw, sampling)
            for j, token in finals.items():
                next_ids[j] = token
            return ForwardResult(step=plan.step, next_ids=next_ids, logprobs=logprobs, prompt_logprobs=prompt,
                                 errors=errors, drafted=drafted)
        adjusted = raw.clone()  # logprobs stay the model's own; only the choice is penalized / constrained
        refused = self._penalize(adjusted, penalized, sampling.output_index) if penalized else {}
        if processed:  # after the penalties, before the grammar: no processor can unmask what a grammar forbids
            refused.update(self.processing.apply(adjusted, processed, sampling.output_index))
        if rows:
            try:
                filled = masks.result()
            except Exception as exc:  # a bug around the grammars: the constrained rows fail, the others go on
                log.exception("filling the grammar masks failed")
                filled = Masks(errors={j: f"{type(exc).__name__}: {exc}" for j, rid in enumerate(rows) if rid})
            self.constraints.apply(adjusted, filled)
            refused.update(filled.errors)
            refused.update({j: start_errors[rid] for j, rid in enumerate(rows) if rid in start_errors})
        next_ids, logprobs, errors = sample_rows(adjusted, sampling, logprob_logits=raw)
        for j, token in finals.items():  # (a drafted request is never penalized nor constrained)
            next_ids[j] = token
        for j in refused:  # a row that could not be penalized / constrained is not sampled: it fails alone
            next_ids[j] = None
            logprobs.pop(j, None)
        done, refused_tokens = self.constraints.advance(rows, next_ids) if rows else ([], {})
        if penalized:
            self.penalties.count(penalized, next_ids)
        errors.update({**refused, **refused_tokens})
        return ForwardResult(step=plan.step, next_ids=next_ids, logprobs=logprobs, prompt_logprobs=prompt,
                             grammar_done=done, errors=errors, drafted=drafted)

    def _penalize(self, logits: torch.Tensor, rows: list[str | None], output_index: list[int]) -> dict[int, str]:
        """The penalties, in place; a bug in them fails the penalized rows, never the step."""
        try:
            return self.penalties.apply(logits, rows, output_index)
        except Exception as exc:
            log.exception("applying the penalties failed")
            return {j: f"{type(exc).__name__}: {exc}" for j, rid in enumerate(rows) if rid}

    def _share(self, plan: ForwardPlan) -> None:
        """A rank other than 0: the step's forward, for the collectives rank 0 takes part in. The plan is the
        same on every rank, so a step that fails here fails on rank 0 too (which reports it)."""
        try:  # what rank 0 checks before its forward, checked the same way: both skip the forward or neither
            batch = self._batch(plan)
            SamplingInputs.from_batch(plan.sampling, self.device)
        except Exception:
            return None
        try:
            self._run(batch)
        except Exception:
            self._end_if_parallel(plan)
        return None

    def _end_if_parallel(self, plan: ForwardPlan) -> None:
        """A forward that raised on one rank may not have on the others (out of memory, a timed-out collective):
        their collectives are no longer in step, and nothing can put them back. With tp > 1 the rank ends (the
        exception goes up and ends the actor), and the launcher ends the server."""
        if self.tp.size > 1:
            log.critical("step %d failed on rank %d of %d: the ranks' collectives cannot stay in step; ending",
                         plan.step, self.tp.rank, self.tp.size)
            raise
