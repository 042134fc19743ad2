"""Server arguments: the CLI flags, with underscores. Frozen; "auto" values are resolved into a new instance."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from radixserve.errors import did_you_mean

DTYPES = ("auto", "bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
# the closed sets: the CLI lists them (argparse choices), __post_init__ checks them (aliases are normalised first)
RESOLVED = ("decode_fallback",)  # fields resolved() sets: no flag of their own
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES,
    "kv_cache_dtype": (*DTYPES, "int8", "fp8_e4m3", "fp8_e5m2"),
    "quantization": ("int8", "int4", "gguf", "none"),
    "device": ("auto", "cpu", "cuda"),
    "attention_backend": ("auto", "triton", "torch", "batch-invariant"),
    "decode_kernel": ("auto", "native", "compiled", "eager"),
    "dist_backend": ("auto", "gloo", "nccl"),
    "log_level": ("debug", "info", "warning", "error", "critical"),
    "hicache_kv_format": ("auto", "int8", "fp8_e4m3"),
}
BUILT_IN_DRAFTS = ("none", "ngram", "suffix", "radix", "draft-model")  # --speculative-algorithm's (any case)
DRAFT_MODEL_NAMES = ("standalone", "draft-model")  # a second model's drafts: SGLang's name and the policy's
NOT_BUILT_DRAFTS = ("eagle", "eagle3", "mtp")  # SGLang's algorithms that need a model's own draft heads
KV_CODE_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")  # --kv-cache-dtype held as 8-bit codes (model/kv_codes.py)
DEFAULT_MAX_TOTAL_TOKENS = 65536  # the CPU pool's default cap, in tokens of the model's dtype (its bytes for codes)
KV_MEMORY_FRACTION = 0.3  # of the RAM available at start, when --max-total-tokens is not given
GPU_MEM_FRACTION = 0.85  # CUDA: of the GPU's memory, for weights and the KV pool (the rest: activations, CUDA)


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None  # a folder, a .gguf file or a hub id (local HF cache); None: the bundled SmolLM2
    revision: str | None = None  # of a hub id: a branch, tag or commit (None: main, or the id's @revision)
    tokenizer_path: str | None = None  # None: the model's own
    chat_template: str | None = None  # a Jinja file or a built-in name (actors/jinja_templates.py); None: the model's
    # auto: the format the chat template shows tools in (the tokenizer actor resolves it), none, or a parser's name
    tool_call_parser: str = "auto"
    trust_remote_code: bool = False  # accepted for SGLang's muscle memory, refused when set: no remote code runs
    dtype: str = "auto"  # auto: bfloat16 on CPU
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; int8, fp8_e4m3, fp8_e5m2: 8-bit codes, a scale per head
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from memory
    chunked_prefill_size: int = 2048  # new tokens per prefill step; <= 0 disables chunking
    max_prefill_tokens: int = 16384  # new tokens per prefill step when chunking is off
    max_running_requests: int = 128
    context_length: int | None = None  # None: the model's max_position_embeddings
    schedule_policy: str = "fcfs"
    eviction_policy: str = "lru"
    disable_radix_cache: bool = False
    # SGLang's HiCache: host-memory (L2) and storage (L3) tiers below the pool (cache/tiers.py, model/kv_tiers.py)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # L2's bytes as a multiple of the pool's (unless hicache_size is given)
    hicache_size: float = 0.0  # L2's size in GB; 0: by hicache_ratio
    hicache_write_policy: str = "write_through"  # entry points radixserve.write_policies
    hicache_storage_backend: str = "file"  # entry points radixserve.kv_storage; "none": host memory only
    hicache_storage_prefetch_policy: str = "timeout"  # entry points radixserve.prefetch_policies
    hicache_storage_backend_extra_config: str | None = None  # JSON: file {"path", "max_bytes"}; redis {"url", ...}
    hicache_page_size: int = 64  # tokens per page below the pool
    hicache_kv_format: str = "auto"  # pages below the pool: auto (the pool's dtype, exact), int8, fp8_e4m3
    kv_disk_bytes: int | None = None  # the file backend's budget; None: 8 GiB or half the free disk
    # speculative decoding (actors/scheduler/speculate.py): drafts from a draft policy, verified in one forward
    speculative_algorithm: str | None = None  # NGRAM, SUFFIX, RADIX (any case), or a draft policy's entry point
    speculative_num_draft_tokens: int = 8  # the most tokens a draft may have
    speculative_draft_width: int = 3  # the most children a draft token may have (SUFFIX's and RADIX's trees; 1: chains)
    speculative_draft_model_path: str | None = None  # STANDALONE's draft model: a HF checkpoint folder
    # SGLang's priority scheduling (actors/scheduler/priority.py): priorities order the queue, preempt, drop
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False  # with it: smaller priority values are more important
    priority_scheduling_preemption_threshold: int = 10  # an arrival preempts work it outranks by more than this
    disable_priority_preemption: bool = False  # with it: priorities order and drop, never preempt
    default_priority_value: int | None = None  # a request's priority when it gives none; None: 0, or the lowest
    # with priority scheduling (SGLang's)
    logit_processors: tuple[str, ...] | None = None  # named processors requests may use (radixserve.logit_processors)
    enable_custom_logit_processor: bool = False  # SGLang's switch for code sent in requests: refused, see HELP
    shadow_policies: str | None = None  # "all" or names: every pair replayed on the live trace (a shadow process)
    shadow_window: float = 60.0  # seconds of trace the shadow statistics cover
    auto_policy: bool = False  # switch to the shadow leader (hysteresis)
    auto_policy_metric: str = "ttft_mean_s"
    auto_policy_margin: float = 0.1
    auto_policy_hold: float = 10.0
    auto_policy_cooldown: float = 30.0
    host: str = "127.0.0.1"
    port: int = 30000
    tp: int = 1  # tensor-parallel ranks (runner processes), over torch.distributed
    dp: int = 1  # data-parallel replicas: scheduler + runner(s) each, behind one api and tokenizer
    routing_policy: str = "cache-aware"  # which replica takes a request (entry points radixserve.routing_policies)
    nnodes: int = 1  # machines the ranks run on (tp / nnodes ranks each)
    node_rank: int = 0  # this machine's place; node 0 runs the api, tokenizer, scheduler and ranks 0..
    dist_init_addr: str | None = None  # HOST:PORT of node 0 (torch.distributed's store; PORT+1, PORT+2 too)
    dist_backend: str = "auto"  # auto: nccl on CUDA, gloo on the CPU
    dist_timeout: float = 60.0  # seconds a collective may take (a node silent 10 s, or this if shorter, is dead)
    dist_auth_key_file: str | None = None  # the nodes' shared Curve key; None: $RADIXSERVE_CACHE/dist-auth.key
    log_level: str = "info"
    api_key: str | None = None  # on the command line (ps shows it): api_key_file or $RADIXSERVE_API_KEY keep it out
    api_key_file: str | None = None  # a file holding the key (one of api_key, api_key_file, $RADIXSERVE_API_KEY)
    allowed_hosts: tuple[str, ...] | None = None  # Host values answered besides loopback and the bound address
    max_connections: int = 512  # open HTTP connections; a request beyond them: 503 + Retry-After
    max_streams: int = 256  # open streamed (SSE) responses; a stream beyond them: 503 + Retry-After
    stream_interval: int = 1  # a stream's tokens go out every this many (SGLang's flag); 1: each as it comes
    served_model_name: tuple[str, ...] | None = None  # names clients may pass, the first listed; None: the model's
    num_threads: int | None = None  # torch threads of the runner; None: all cores
    device: str = "auto"  # auto: cuda if torch sees a GPU, else cpu
    attention_backend: str = "auto"  # auto: triton on cuda, torch on cpu
    max_queued_requests: int = 1024  # sequences waiting beyond the running ones; more: 429
    # prompts x n in one HTTP request; more: 429. None: --max-queued-requests + --max-running-requests
    max_sequences_per_request: int | None = None
    queue_timeout: float | None = None  # seconds a request may wait to start; longer: 503. None: no limit
    shutdown_timeout: float = 10.0  # seconds SIGTERM/SIGINT waits for requests in flight before stopping
    random_seed: int | None = None  # seeds the runner's unseeded sampling noise at start; None: a fresh seed
    deterministic: bool = False  # batch-invariant results (CPU): a request's tokens never depend on the batch
    disable_overlap_schedule: bool = False  # plan a decode step only once the one before it returned (SGLang's)
    quantization: str | None = None  # int8 | int4 | gguf: weight-only quantized linear layers (CPU)
    # auto | native | compiled | eager: how CPU decode steps run (_decode_kernels); $RADIXSERVE_DECODE_KERNEL: default
    decode_kernel: str = field(default_factory=lambda: os.environ.get("RADIXSERVE_DECODE_KERNEL", "auto"))
    # set by resolved(), never a flag: the kernels auto tries in turn if decode_kernel cannot load here (a build
    # that fails, a shape the native step refuses, no compiler for torch.compile); () -- asked for by name -- fails
    decode_fallback: tuple[str, ...] = ()
    disable_compile: bool = False  # eager decode: the same as --decode-kernel eager
    mem_fraction_static: float | None = None  # CUDA: share of the GPU's memory for weights + KV pool (0.85)
    check_invariants: bool = False  # check pool accounting after every step (tests, debugging)

    def __post_init__(self) -> None:
        self._check_choices()
        if self.trust_remote_code:
            from radixserve.model.loader import supported_model_types  # no torch

            raise ValueError(f"--trust-remote-code: radixserve runs only the architectures it implements "
                             f"({', '.join(supported_model_types())}); remote code is never executed. Drop the flag "
                             "(a checkpoint of one of these architectures loads without it)")
        names = self.served_model_name
        if names is not None:  # one name (Engine, SGLang's single string) or several (aliases); frozen as a tuple
            names = (names,) if isinstance(names, str) else tuple(names)
            if not names or not all(isinstance(n, str) and n.strip() for n in names):
                raise ValueError(f"served_model_name={self.served_model_name!r}: give one or more non-empty names")
            object.__setattr__(self, "served_model_name", tuple(dict.fromkeys(names)))  # normalising, not patching
        if self.random_seed is not None and not 0 <= self.random_seed < 2**63:
            raise ValueError(f"random_seed={self.random_seed} must be in 0..2**63-1")
        for name in ("max_total_tokens", "context_length"):
            value = getattr(self, name)
            if value is not None and value < 2:
                raise ValueError(f"{name}={value} is too small (need at least 2 tokens)")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests} must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens} must be >= 1")
        if self.tp < 1:
            raise ValueError(f"tp={self.tp} must be >= 1")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests={self.max_queued_requests} must be >= 0")
        if self.quantization and self.deterministic:
            raise ValueError("--quantization and --deterministic cannot be combined: a quantized layer switches "
                             "kernels with the number of rows, which is what batch invariance forbids")
        if self.disable_compile and self.decode_kernel not in ("auto", "eager"):
            raise ValueError(f"--disable-compile means eager decode steps; it contradicts --decode-kernel "
                             f"{self.decode_kernel}")
        if self.deterministic and self.decode_kernel not in ("auto", "eager"):
            raise ValueError(f"--deterministic runs its own batch-invariant kernels; --decode-kernel "
                             f"{self.decode_kernel} cannot be combined with it")
        if self.allowed_hosts is not None:  # frozen as a tuple; a bad entry fails here, not at the first request
            from radixserve.actors.api.hosts import AllowedHosts

            object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
            AllowedHosts.build(self.host, self.allowed_hosts)
        if self.max_connections < 1 or self.max_streams < 1:
            raise ValueError(f"max_connections={self.max_connections} and max_streams={self.max_streams} must be "
                             ">= 1")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval={self.stream_interval} must be >= 1")
        if self.max_sequences_per_request is not None and self.max_sequences_per_request < 1:
            raise ValueError(f"max_sequences_per_request={self.max_sequences_per_request} must be >= 1")
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            raise ValueError(f"queue_timeout={self.queue_timeout} must be > 0 seconds (leave it unset for no limit)")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout} must be >= 0 seconds")
        self._check_priority()
        self._check_hicache()
        self._check_speculative()
        self._check_logit_processors()
        self._check_distributed()
        self._check_shadow()

    def _check_choices(self) -> None:
        """Every closed-set field holds one of CHOICES (aliases such as bf16 made canonical, quantization "none"
        made None: normalising at construction, not patching later)."""
        for name in ("dtype", "kv_cache_dtype"):
            object.__setattr__(self, name, DTYPE_ALIASES.get(getattr(self, name), getattr(self, name)))
        if self.quantization == "none":
            object.__setattr__(self, "quantization", None)
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if (value is None and name == "quantization") or (name == "device" and str(value).startswith("cuda:")):
                continue  # no quantization; a rank's own GPU (the runner sets cuda:N)
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")

    def _check_priority(self) -> None:
        if not self.enable_priority_scheduling:
            for name in ("schedule_low_priority_values_first", "disable_priority_preemption"):
                if getattr(self, name):
                    raise ValueError(f"--{name.replace('_', '-')} changes priority scheduling, which is off: add "
                                     "--enable-priority-scheduling")
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError(f"--priority-scheduling-preemption-threshold "
                             f"{self.priority_scheduling_preemption_threshold} must be >= 0 (below 0, requests of one "
                             "priority would preempt each other in turn)")
        value = self.default_priority_value
        if value is not None and not -(2**31) <= value < 2**31:
            raise ValueError(f"--default-priority-value {value} must be a 32-bit integer, as request priorities are")

    @property
    def draft_policy(self) -> str:
        """--speculative-algorithm as a draft policy's name (policies/drafts.py): "none" when off."""
        name = self.speculative_algorithm or "none"
        if name.lower() in DRAFT_MODEL_NAMES:
            return "draft-model"
        return name.lower() if name.lower() in BUILT_IN_DRAFTS else name

    def _check_speculative(self) -> None:
        name = (self.speculative_algorithm or "").lower()
        if name in NOT_BUILT_DRAFTS:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm}: drafting with the model's own "
                             "draft heads is not built yet; built: NGRAM, SUFFIX, RADIX and STANDALONE (a draft "
                             "model, --speculative-draft-model-path)")
        path = self.speculative_draft_model_path
        if name in DRAFT_MODEL_NAMES and not path:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm} drafts with a second model: give "
                             "its checkpoint folder as --speculative-draft-model-path")
        if path and not self.speculative_algorithm:
            raise ValueError("--speculative-draft-model-path is for speculative decoding: add --speculative-algorithm "
                             "STANDALONE")
        if path and not (Path(path) / "config.json").is_file():
            raise ValueError(f"--speculative-draft-model-path {path}: not a Hugging Face checkpoint folder (no "
                             "config.json there)")
        if not 1 <= self.speculative_draft_width <= 8:
            raise ValueError(f"--speculative-draft-width {self.speculative_draft_width} must be in 1..8")
        if not 1 <= self.speculative_num_draft_tokens <= 64:
            raise ValueError(f"--speculative-num-draft-tokens {self.speculative_num_draft_tokens} must be in 1..64")

    def _check_hicache(self) -> None:
        if not self.enable_hierarchical_cache:
            return
        if self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache keeps the radix cache's pages below the pool: it cannot be "
                             "combined with --disable-radix-cache")
        if self.tp > 1:
            raise ValueError("--enable-hierarchical-cache is not implemented with --tp > 1 yet (each rank would keep "
                             "its own share of every page); use --dp for several replicas sharing one L3")
        if self.kv_cache_dtype in KV_CODE_FORMATS and self.hicache_kv_format != "auto":
            raise ValueError(f"--hicache-kv-format {self.hicache_kv_format} re-encodes pages of a pool in the model's "
                             f"dtype; with --kv-cache-dtype {self.kv_cache_dtype} the pool's pages are 8-bit already "
                             "and move below it as they are: leave --hicache-kv-format at auto")
        if self.hicache_page_size < 1:
            raise ValueError(f"--hicache-page-size {self.hicache_page_size} must be >= 1 token")
        if not self.hicache_ratio > 0 or self.hicache_size < 0:
            raise ValueError(f"--hicache-ratio {self.hicache_ratio} must be > 0 and --hicache-size "
                             f"{self.hicache_size} >= 0 (GB; 0: by ratio)")
        if self.kv_disk_bytes is not None and self.kv_disk_bytes < 1:
            raise ValueError(f"--kv-disk-bytes {self.kv_disk_bytes} must be >= 1")
        self.hicache_extra_config()  # fails fast on bad JSON

    def hicache_extra_config(self) -> dict[str, Any]:
        """--hicache-storage-backend-extra-config parsed (a JSON object), with --kv-disk-bytes as max_bytes."""
        import json

        text = self.hicache_storage_backend_extra_config
        try:
            config = json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hicache-storage-backend-extra-config is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError("--hicache-storage-backend-extra-config must be a JSON object, e.g. "
                             "'{\"path\": \"/var/cache/kv\"}'")
        if self.kv_disk_bytes is not None:
            config.setdefault("max_bytes", self.kv_disk_bytes)
        return config

    def _check_logit_processors(self) -> None:
        names = self.logit_processors
        if names is not None:  # one name (Engine) or several; frozen as a tuple
            names = (names,) if isinstance(names, str) else tuple(dict.fromkeys(names))
            object.__setattr__(self, "logit_processors", names or None)  # normalising, not patching
        if self.enable_custom_logit_processor and not self.logit_processors:
            raise ValueError("--enable-custom-logit-processor: radixserve never runs code sent in a request (SGLang's "
                             "dill-serialized processors); list the installed processors requests may use by name "
                             "with --logit-processors NAME... (built in: allow-tokens, ban-tokens)")

    def _check_shadow(self) -> None:
        from radixserve.lab.auto_policy import METRICS

        if self.auto_policy and not self.shadow_policies:
            raise ValueError("--auto-policy switches to the best shadow pair: give --shadow-policies all (or the "
                             "policies to choose among)")
        if self.auto_policy_metric not in METRICS:
            raise ValueError(f"--auto-policy-metric {self.auto_policy_metric!r}: choose one of {', '.join(METRICS)}")
        if not self.shadow_policies:
            return
        if self.disable_radix_cache:
            raise ValueError("--shadow-policies compares cache policies; with --disable-radix-cache there is no "
                             "cache to compare them on")
        if self.dp > 1:
            raise ValueError("--shadow-policies shadows one scheduler; with --dp > 1 it is not implemented yet")
        if not self.shadow_window > 0:
            raise ValueError(f"--shadow-window {self.shadow_window} must be > 0 seconds")
        if min(self.auto_policy_margin, self.auto_policy_hold, self.auto_policy_cooldown) < 0:
            raise ValueError("--auto-policy-margin, --auto-policy-hold and --auto-policy-cooldown must be >= 0")

    def _check_distributed(self) -> None:
        if self.dp < 1:
            raise ValueError(f"dp={self.dp} must be >= 1")
        if self.dp > 1 and self.nnodes > 1:
            raise ValueError("--dp > 1 runs its replicas on one machine; across machines, run a server per machine "
                             "and `radixserve router` in front of them")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.tp % self.nnodes:
            raise ValueError(f"--tp {self.tp} ranks cannot be spread evenly over --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every "
                             "node)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65534:
                raise ValueError(f"--dist-init-addr {self.dist_init_addr!r} is not HOST:PORT (PORT, PORT+1 and "
                                 "PORT+2 are used)")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout={self.dist_timeout} must be > 0 seconds")
        if self.tp > 1 and self.quantization:
            raise ValueError(f"--quantization {self.quantization} is not implemented with --tp > 1 yet: run the "
                             "quantized model on one rank, or the full-precision one over several")
        if self.tp > 1 and self.deterministic:
            raise ValueError("--deterministic is not implemented with --tp > 1: the ranks' partial sums are added "
                             "by the collective in its own order")

    @property
    def ranks_here(self) -> range:
        """The tensor-parallel ranks this node runs."""
        per = self.tp // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown server argument(s) {', '.join(unknown)}{did_you_mean(unknown[0], names)}; "
                             f"valid: {', '.join(sorted(names))}")
        return cls(**kwargs)

    def resolved(self, kv_values_per_token: int, model_context: int, num_parameters: int = 0,
                 kv_values_per_rank: int | None = None, head_dim: int = 64) -> ServerArgs:
        """A copy with every auto value made concrete (the frozen config the actors run on).

        ``kv_values_per_token``: K and V elements one token takes over all layers (2 * layers * kv_heads * head_dim);
        ``num_parameters``: the model's weights (on CUDA the pool gets what the weights leave of the GPU's share);
        ``kv_values_per_rank``: with --tp, what one rank's share of the heads takes per token (KV heads copied to
        several ranks count on each). A GPU holds one rank's weights and pool; a CPU node's memory all its ranks'.
        ``head_dim``: a KV head's values (8-bit codes carry a float32 scale per head).
        """
        dtype = "bfloat16" if self.dtype == "auto" else self.dtype
        codes = self.kv_cache_dtype in KV_CODE_FORMATS
        if not codes and self.kv_cache_dtype not in ("auto", dtype):
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} is not implemented: the KV pool holds the "
                             f"model's dtype ({dtype}) or 8-bit codes ({', '.join(KV_CODE_FORMATS)}); leave it at "
                             f"auto, set --dtype {self.kv_cache_dtype}, or take one of the 8-bit formats")
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        per_rank = kv_values_per_rank or kv_values_per_token
        on_cuda = device.startswith("cuda")
        if on_cuda and self.dp > 1:
            raise ValueError("--dp > 1 on CUDA is not implemented yet (each replica needs GPUs of its own); run a "
                             "server per GPU and `radixserve router` in front of them")
        # a CPU node's memory holds every rank's pool of every replica
        values = per_rank * (1 if on_cuda else len(self.ranks_here) * self.dp)
        plain_bytes_per_token = values * (4 if dtype == "float32" else 2)
        kv_bytes_per_token = values + values // head_dim * 4 if codes else plain_bytes_per_token
        num_parameters //= self.tp if on_cuda else 1
        context = min(self.context_length or model_context, model_context)
        total = self.max_total_tokens
        if total is None and device.startswith("cuda"):
            weight_bytes = num_parameters * (4 if dtype == "float32" else 2)
            total = gpu_pool_tokens(self.mem_fraction_static or GPU_MEM_FRACTION, weight_bytes, kv_bytes_per_token)
        elif total is None:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            # not forced up to the context: a long-context model on a small machine gets a smaller pool (requests
            # that cannot fit are refused with a message naming --max-total-tokens) instead of running out of RAM
            cap = DEFAULT_MAX_TOTAL_TOKENS * plain_bytes_per_token // kv_bytes_per_token  # codes: the same bytes
            total = max(256, min(cap, int(avail * KV_MEMORY_FRACTION / kv_bytes_per_token)))
        chain = self._decode_kernels(dtype, device)
        kernel = chain[0]
        backend = self.dist_backend if self.dist_backend != "auto" else "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl" and not device.startswith("cuda"):
            raise ValueError("--dist-backend nccl needs CUDA devices; on the CPU use gloo")
        if backend == "gloo" and device.startswith("cuda") and self.tp > 1:
            raise ValueError("--dist-backend gloo cannot gather CUDA tensors (the logits of the vocabulary shards); "
                             "use nccl on CUDA")
        return dataclasses.replace(self, dtype=dtype, kv_cache_dtype=self.kv_cache_dtype if codes else dtype,
                                   context_length=context,
                                   max_total_tokens=total, device=device, decode_kernel=kernel,
                                   decode_fallback=chain[1:] if self.decode_kernel == "auto" else (),
                                   disable_compile=kernel == "eager", dist_backend=backend,
                                   max_sequences_per_request=self.max_sequences_per_request
                                   or self.max_queued_requests + self.max_running_requests)

    def _decode_kernels(self, dtype: str, device: str) -> tuple[str, ...]:
        """The kernel to serve decode steps with, then what auto falls back to if it cannot load (ModelRunner):
        native (the C++ decode step) where this CPU, compiler, dtype and weights allow it, then compiled
        (torch.compile'd layers, which need a C++ compiler too), then eager; eager alone where the others would
        change what is promised (--deterministic's own kernels), on CUDA and with --disable-compile.
        RADIXSERVE_DISABLE_COMPILE=1 (test runs: compiling costs seconds per start) takes compiled out of the chain."""
        from radixserve.kernels.cpp_build import NativeUnavailable, compiler  # no torch: the scheduler resolves too
        from radixserve.kernels.cpu_native import unavailable_reason

        if self.disable_compile or self.deterministic or device != "cpu" or self.tp > 1:
            if self.decode_kernel not in ("auto", "eager"):
                raise ValueError(f"--decode-kernel {self.decode_kernel} runs on the CPU only, not on {device}"
                                 if device != "cpu" else f"--decode-kernel {self.decode_kernel} runs one whole step "
                                 "on one rank; with --tp > 1 decode steps run eagerly" if self.tp > 1 else
                                 f"--decode-kernel {self.decode_kernel} contradicts --disable-compile")
            return ("eager",)
        no_compile = os.environ.get("RADIXSERVE_DISABLE_COMPILE") == "1"  # torch.compile off (test runs)
        if no_compile and self.decode_kernel == "compiled":
            raise ValueError("--decode-kernel compiled is off here (RADIXSERVE_DISABLE_COMPILE=1)")
        why = unavailable_reason(dtype)
        if self.decode_kernel == "native" and why:
            raise ValueError(f"--decode-kernel native: {why}")
        if self.decode_kernel != "auto":
            return (self.decode_kernel,)
        try:
            compiler()
            compiles = () if no_compile else ("compiled",)
        except NativeUnavailable:
            compiles = ()
        return (*(() if why else ("native",)), *compiles, "eager")


def gpu_pool_tokens(fraction: float, weight_bytes: int, kv_bytes_per_token: int) -> int:
    """KV pool tokens on the current GPU, as SGLang sizes it: of ``fraction`` of the device's memory, what the
    weights and whatever else already holds memory there leave. ValueError if that is not even 256 tokens."""
    import torch

    free, total = torch.cuda.mem_get_info()
    budget = free - (1 - fraction) * total - weight_bytes
    tokens = int(budget // kv_bytes_per_token)
    if tokens < 256:
        raise ValueError(f"the GPU has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB; with "
                         f"--mem-fraction-static {fraction} and {weight_bytes / 2**30:.1f} GiB of weights that leaves "
                         f"room for {max(tokens, 0)} KV tokens: raise --mem-fraction-static, free the GPU, or set "
                         "--max-total-tokens")
    return tokens
