"""Everything decided once, before the engine starts: the model files, its config, the resolved (frozen)
server arguments and the scheduler's config. Shared by the server's launcher and the offline Engine."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.actors.jinja_templates import load_chat_template
from radixserve.actors.scheduler.priority import PriorityConfig
from radixserve.actors.scheduler.scheduler import SchedulerConfig
from radixserve.cache.pages import model_fingerprint, namespace
from radixserve.cache.tiers import TierConfig
from radixserve.logit_processors import ProcessorCatalog
from radixserve.model.config import ModelConfig
from radixserve.model.loader import ModelFiles, load_configs, resolve_model, resolve_tokenizer
from radixserve.model.parallel import check_divisible, kv_heads_per_rank
from radixserve.policies import available, load_draft_policy, load_eviction_policy, load_schedule_policy
from radixserve.policies.drafts import DraftOptions
from radixserve.server_args import ServerArgs


@dataclass
class Prepared:
    args: ServerArgs  # resolved
    files: ModelFiles
    model: ModelConfig
    scheduler_config: SchedulerConfig
    model_names: tuple[str, ...]  # what /v1/models lists and clients pass as "model"; the first is the primary
    tokenizer_dir: Path  # the tokenizer's HF folder (--tokenizer-path, else the model's)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def model_info(self, chat_template: dict[str, Any] | None) -> dict[str, Any]:
        """``GET /get_model_info`` (SGLang's fields). ``model_path`` is the path the model was loaded from, as
        given: SGLang's frontend picks its chat template by matching it, and that match must see the truth.
        ``chat_template``: the role markers of the model's own template (radixserve.lang reads them)."""
        return {
            "model_path": self.files.given,
            "tokenizer_path": self.args.tokenizer_path or self.files.given,
            "served_model_name": self.model_name,
            "is_generation": True,
            "model_type": self.model.model_type,
            "context_length": self.args.context_length,
            "vocab_size": self.model.vocab_size,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "chat_template": chat_template,
        }


def tier_config(args: ServerArgs, model_dir: Path) -> TierConfig | None:
    """--enable-hierarchical-cache: the pages' size, policies and namespace (pages of another model, dtype, page
    size or format have other keys). Fails fast on unknown policy or backend names."""
    if not args.enable_hierarchical_cache:
        return None
    from radixserve.plugins import registered
    from radixserve.policies import load_prefetch_policy, load_write_policy

    load_write_policy(args.hicache_write_policy), load_prefetch_policy(args.hicache_storage_prefetch_policy)
    backend = args.hicache_storage_backend
    if backend != "none" and backend not in registered("radixserve.kv_storage"):
        names = ", ".join(["none", *registered("radixserve.kv_storage")])
        raise ValueError(f"unknown --hicache-storage-backend {backend!r}; available: {names}")
    # what else the KV's bits depend on: weight quantization, and --deterministic's own kernels (its promise of
    # the same bits whatever the batch would not hold for KV computed without it)
    compute = f"{args.dtype}/{args.quantization or 'none'}/{'deterministic' if args.deterministic else 'default'}"
    if args.kv_cache_dtype != args.dtype:  # 8-bit codes: pages of another layout, and other bits
        compute += f"/kv-{args.kv_cache_dtype}"
    ns = namespace(model_fingerprint(model_dir), compute, args.hicache_page_size, args.hicache_kv_format)
    return TierConfig(args.hicache_page_size, ns, args.hicache_write_policy, args.hicache_storage_prefetch_policy)


def prepare(args: ServerArgs) -> Prepared:
    """Resolve ``args`` against the model; fails fast (ValueError / FileNotFoundError) on bad names or paths."""
    files = resolve_model(args.model_path, args.revision, blocks=args.quantization == "gguf")
    tokenizer_dir = resolve_tokenizer(args.tokenizer_path, files, args.revision)
    if args.chat_template is not None:
        load_chat_template(args.chat_template)  # fail fast on a bad name or file: the tokenizer loads it again
    model = ModelConfig.from_hf(*load_configs(files.path))
    check_divisible(args.tp, model.num_heads, model.num_kv_heads, model.intermediate_size)
    per_rank = 2 * model.num_layers * kv_heads_per_rank(args.tp, model.num_kv_heads) * model.head_dim
    requested = args.decode_kernel
    args = args.resolved(model.kv_values_per_token, model.max_position_embeddings, model.num_parameters, per_rank,
                         model.head_dim)
    if args.decode_kernel == "native" and model.native_refusal:  # what this machine allows, this model may not
        if requested == "native":
            raise ValueError(f"--decode-kernel native: {model.native_refusal}; use --decode-kernel compiled or eager")
        fallback = args.decode_fallback
        args = dataclasses.replace(args, decode_kernel=fallback[0], decode_fallback=fallback[1:])
    load_eviction_policy(args.eviction_policy), load_schedule_policy(args.schedule_policy)  # fail fast on names
    if args.tool_call_parser not in ("auto", "none"):
        from radixserve.tool_parsers import load_tool_parser

        load_tool_parser(args.tool_call_parser)
    ProcessorCatalog(args.logit_processors or ())  # and on logit processors that are not installed or do not load
    if args.draft_policy not in available("draft"):  # and on a draft policy that is not installed (the scheduler
        load_draft_policy(args.draft_policy)  # builds it: a draft model loads there): the registry's error
    if args.dp > 1:
        from radixserve.actors.router.policies import load_routing_policy

        load_routing_policy(args.routing_policy)
    if args.shadow_policies:
        from radixserve.lab.shadow import resolve_pairs

        resolve_pairs(args.shadow_policies, (args.eviction_policy, args.schedule_policy))
    cfg = SchedulerConfig(
        context_length=args.context_length,
        vocab_size=model.vocab_size,
        eos_ids=model.eos_token_ids,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        queue_timeout_s=args.queue_timeout,
        priority=PriorityConfig(args.enable_priority_scheduling, args.schedule_low_priority_values_first,
                                args.priority_scheduling_preemption_threshold, not args.disable_priority_preemption,
                                args.default_priority_value, args.max_queued_requests),
        logit_processors=args.logit_processors or (),
        tiers=tier_config(args, files.path),
        draft_policy=args.draft_policy,
        draft_tokens=args.speculative_num_draft_tokens if args.draft_policy != "none" else 0,
        draft_sampled=args.random_seed is None,
        draft_options=DraftOptions(args.speculative_draft_model_path,
                                   "float32" if args.dtype == "float32" else "bfloat16",
                                   width=args.speculative_draft_width),
        # the ranks other than 0 learn a step's input tokens from its plan; under --random-seed, which steps run (a
        # finished request's extra one among them) must not depend on when messages arrive
        overlap=not args.disable_overlap_schedule and args.tp == 1 and args.random_seed is None,
        check_invariants=args.check_invariants,
    )
    names = args.served_model_name or (files.hub_id or (files.source.stem.split(".")[0] if files.source.suffix ==
                                                        ".gguf" else files.source.resolve().name),)
    return Prepared(args, files, model, cfg, names, tokenizer_dir)
