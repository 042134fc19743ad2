"""The server's command line, built from ServerArgs: one flag per field (``--max-total-tokens`` for
``max_total_tokens``), typed from the field's type, every closed set listed as choices, ``--flag/--no-flag`` for
every switch, defaults shown, grouped in sections as SGLang's ``--help`` is; SGLang's names kept as aliases. An
unknown flag is named with the closest known one; every parse error is one line and exit code 2.
"""
from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, fields
from typing import Any

from radixserve.errors import did_you_mean
from radixserve.server_args import CHOICES, DTYPE_ALIASES, RESOLVED, ServerArgs

GROUPS: dict[str, tuple[str, ...]] = {
    "model and tokenizer": ("model_path", "revision", "tokenizer_path", "chat_template", "tool_call_parser",
                            "trust_remote_code",
                            "context_length", "dtype", "quantization", "kv_cache_dtype"),
    "runtime and memory": ("device", "attention_backend", "decode_kernel", "disable_compile", "num_threads",
                           "max_total_tokens", "mem_fraction_static", "chunked_prefill_size", "max_prefill_tokens",
                           "max_running_requests", "random_seed", "deterministic", "disable_overlap_schedule"),
    "scheduling and cache policies": ("schedule_policy", "eviction_policy", "disable_radix_cache", "shadow_policies",
                                      "shadow_window", "auto_policy", "auto_policy_metric", "auto_policy_margin",
                                      "auto_policy_hold", "auto_policy_cooldown"),
    "hierarchical cache (KV below the pool)": (
        "enable_hierarchical_cache", "hicache_ratio", "hicache_size", "hicache_write_policy",
        "hicache_storage_backend", "hicache_storage_prefetch_policy", "hicache_storage_backend_extra_config",
        "hicache_page_size", "hicache_kv_format", "kv_disk_bytes"),
    "speculative decoding": ("speculative_algorithm", "speculative_num_draft_tokens", "speculative_draft_width",
                             "speculative_draft_model_path"),
    "priority scheduling": ("enable_priority_scheduling", "schedule_low_priority_values_first",
                            "priority_scheduling_preemption_threshold", "disable_priority_preemption",
                            "default_priority_value"),
    "logit processors": ("logit_processors", "enable_custom_logit_processor"),
    "parallelism": ("tp", "dp", "routing_policy", "nnodes", "node_rank", "dist_init_addr", "dist_backend",
                    "dist_timeout", "dist_auth_key_file"),
    "api server": ("host", "port", "api_key_file", "api_key", "allowed_hosts", "served_model_name",
                   "max_queued_requests", "max_sequences_per_request", "max_connections", "max_streams",
                   "stream_interval", "queue_timeout", "shutdown_timeout"),
    "logging": ("log_level",),
    "debugging": ("check_invariants",),
}
ALIASES = {  # SGLang's (and vLLM's) names for the same flags
    "model_path": ["--model"],
    "tp": ["--tp-size", "--tensor-parallel-size"],
    "dp": ["--dp-size", "--data-parallel-size"],
    "eviction_policy": ["--radix-eviction-policy"],
    "deterministic": ["--enable-deterministic-inference"],
    "hicache_page_size": ["--page-size"],
}
METAVARS = {"model_path": "PATH_OR_HUB_ID", "tokenizer_path": "PATH_OR_HUB_ID", "chat_template": "NAME_OR_FILE",
            "served_model_name": "NAME", "dist_init_addr": "HOST:PORT", "dist_auth_key_file": "FILE",
            "api_key": "KEY", "api_key_file": "PATH", "allowed_hosts": "HOST", "host": "HOST",
            "port": "PORT", "shadow_policies": "all|NAMES", "revision": "REV", "tool_call_parser": "NAME",
            "logit_processors": "NAME", "priority_scheduling_preemption_threshold": "N", "default_priority_value": "N",
            "speculative_algorithm": "NAME", "speculative_num_draft_tokens": "K", "speculative_draft_width": "W",
            "speculative_draft_model_path": "PATH"}
HELP = {
    "speculative_algorithm": "guess each request's next tokens and verify them in one forward (greedy: the same "
                             "tokens; sampled: the same distribution): NGRAM (the request's own earlier tokens: "
                             "prompt lookup), SUFFIX (the longest matching suffix in this request and earlier ones), "
                             "RADIX (the radix cache's continuation of the request), STANDALONE (a smaller draft "
                             "model, --speculative-draft-model-path), or a plugin's (entry points "
                             "radixserve.draft_policies) (default: none: off)",
    "speculative_num_draft_tokens": "the most tokens a draft may have (a draft tree's: all its branches')",
    "speculative_draft_width": "the most children a draft token may have: above 1, SUFFIX and RADIX draft trees "
                               "(their likeliest continuations where earlier text went on in more than one way), "
                               "verified in the same one forward under a tree mask; 1: chains (default: 3)",
    "speculative_draft_model_path": "STANDALONE's draft model: a Hugging Face checkpoint folder of a smaller model "
                                    "with the served model's tokenizer (run by transformers in the scheduler's "
                                    "process, one thread) (default: none)",
    "enable_hierarchical_cache": "keep the radix cache's pages below the pool too: host memory (L2) and storage (L3, "
                                 "kept across restarts); a request whose prefix left the pool reads it back instead "
                                 "of recomputing it",
    "hicache_ratio": "L2's size as a multiple of the pool's bytes",
    "hicache_size": "L2's size in GB (0: by --hicache-ratio)",
    "hicache_write_policy": "when pages go below: write_through (when computed), write_through_selective (when "
                            "reused twice), write_back (when evicted), or a plugin's (entry points "
                            "radixserve.write_policies)",
    "hicache_storage_backend": "L3: file (a folder on local disk), redis (a Redis or Valkey server several servers "
                               "share), none (L2 only), or a plugin's (entry points radixserve.kv_storage)",
    "hicache_storage_prefetch_policy": "how long a request waits for its pages to be read back: best_effort (never), "
                                       "wait_complete (until all are back), timeout (until all are back, at most 1 s "
                                       "+ 10 ms a page), or a plugin's (entry points radixserve.prefetch_policies)",
    "hicache_storage_backend_extra_config": "JSON for the storage backend: file {{\"path\": folder, \"max_bytes\": "
                                            "N}}; redis {{\"url\": \"redis://host:6379/0\", \"prefix\", \"ttl_s\"}} "
                                            "(default: none: the file backend in $RADIXSERVE_CACHE/kv-pages, redis "
                                            "at localhost:6379)",
    "hicache_page_size": "tokens per page below the pool",
    "hicache_kv_format": "pages below the pool: auto (the pool's dtype: exact), int8 or fp8_e4m3 (scaled: keys per "
                         "channel, values per token; 2x (bf16) to 4x (float32) more pages in the same bytes, not "
                         "exact)",
    "kv_disk_bytes": "the file backend's budget in bytes; the least recently used pages go first (default: 8 GiB, or "
                     "half the free disk)",
    "model_path": "a HF checkpoint folder, a .gguf file, or a Hugging Face hub id (org/name, org/name@revision) "
                  "already in the local HF cache ($HF_HUB_CACHE, $HF_HOME/hub; nothing is downloaded) (default: "
                  "the bundled SmolLM2-135M-Instruct)",
    "revision": "the branch, tag or commit of a hub id's cached snapshot (default: main)",
    "tokenizer_path": "where the tokenizer (and its chat template) come from: a folder, hub id or .gguf file "
                      "(default: the model's own)",
    "chat_template": "the chat template for chat requests in place of the tokenizer's: a Jinja file, or a "
                     "built-in: chatml, qwen, llama-3, llama-2, mistral (default: the tokenizer's own)",
    "tool_call_parser": "how the model writes tool calls, read into message.tool_calls on the chat route: "
                        "{tool_parsers}, or a plugin's (entry points radixserve.tool_call_parsers); auto: the "
                        "format the chat template shows tools in (none if it shows none); none: tools are only shown "
                        "to the model (tool_choice none)",
    "trust_remote_code": "refused: radixserve runs only the architectures it implements and never executes a "
                         "checkpoint's code (accepted so SGLang command lines fail with a clear message)",
    "dtype": "weights and activations; auto: bfloat16 (the CPU's fast path; float32 checkpoints too)",
    "kv_cache_dtype": "the KV pool's dtype; auto: the model's dtype; int8, fp8_e4m3, fp8_e5m2: 8-bit codes with a "
                      "float32 scale per token and head (about half the bytes of bf16, so nearly twice the tokens)",
    "max_total_tokens": "KV pool size in tokens (default: from free memory; on CUDA from --mem-fraction-static)",
    "chunked_prefill_size": "new tokens per prefill step; <= 0 disables chunking",
    "max_prefill_tokens": "new tokens per prefill step when chunking is off",
    "max_running_requests": "most requests decoding at once",
    "context_length": "cap on prompt + output tokens (default: the model's)",
    "schedule_policy": "order of the waiting queue: {schedule}, or a plugin's (entry points "
                       "radixserve.schedule_policies)",
    "eviction_policy": "which cached prefixes go first when the pool is full: {eviction}, or a plugin's "
                       "(entry points radixserve.eviction_policies)",
    "disable_radix_cache": "no prefix reuse: every request computes its whole prompt",
    "enable_priority_scheduling": "SGLang's priority scheduling: a request's \"priority\" (larger = more important) "
                                  "orders the queue before the schedule policy does (the policy orders requests of "
                                  "one priority), a more important arrival preempts running work (see "
                                  "--priority-scheduling-preemption-threshold; the preempted request's KV stays "
                                  "cached and it resumes), and with a full queue (--max-queued-requests) the least "
                                  "important waiting request is dropped (503) rather than a more important newcomer",
    "schedule_low_priority_values_first": "with --enable-priority-scheduling: smaller priority values are more "
                                          "important",
    "priority_scheduling_preemption_threshold": "with --enable-priority-scheduling: an arrival preempts a running "
                                                "request only if its priority exceeds that one's by more than this",
    "disable_priority_preemption": "with --enable-priority-scheduling: priorities order the queue and choose what a "
                                   "full queue drops, but never preempt running requests",
    "default_priority_value": "the priority of a request that gives none (default: with "
                              "--enable-priority-scheduling the least important of all, as SGLang's; else 0)",
    "logit_processors": "named logit processors requests may ask for (\"custom_logit_processor\": NAME, "
                        "parameters in \"custom_params\"): installed entry points radixserve.logit_processors, "
                        "built in: allow-tokens, ban-tokens (default: none, requests naming one get 400)",
    "enable_custom_logit_processor": "SGLang's switch for dill-serialized processor code in requests: radixserve "
                                     "never runs code a request sends, so this is refused unless "
                                     "--logit-processors lists the named processors that run instead",
    "shadow_policies": "replay the live traffic, in a low-priority process of its own, through every listed "
                       "eviction x schedule pair: `all`, or names (eviction and schedule names are crossed, "
                       "`lru:lpm` is one pair); GET /policies/shadow, /metrics radixserve_shadow_* (default: none)",
    "shadow_window": "seconds of traffic the shadow statistics cover (a sliding window)",
    "auto_policy": "switch the live policies to the shadow leader once it beats the live pair's shadow by "
                   "--auto-policy-margin for --auto-policy-hold seconds (at most once per --auto-policy-cooldown)",
    "auto_policy_metric": "what the leader is best at",
    "auto_policy_margin": "how much better (relative) the leader must be, e.g. 0.1 = 10%%",
    "auto_policy_hold": "seconds the leader must stay ahead before a switch",
    "auto_policy_cooldown": "seconds after any change of the live policies (by hand too) before a switch",
    "served_model_name": "the model name(s) clients pass as \"model\", space-separated: the first is listed first "
                         "by /v1/models and named in responses to requests without one, any of them is served "
                         "(default: the hub id, else the file or folder name)",
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "require `Authorization: Bearer <key>` on every route but /health and the dashboard's page; the "
               "command line is readable by every local user (ps): prefer --api-key-file or $RADIXSERVE_API_KEY "
               "(default: no key, unless one of those gives it; giving more than one is an error)",
    "api_key_file": "read the API key from this file (all of it, surrounding whitespace ignored; warns if "
                    "other users may read it) (default: none)",
    "allowed_hosts": "Host header values to answer besides the loopback names and addresses, the --host name and "
                     "the address a connection arrived on; others get 421 (DNS rebinding). Names, addresses, "
                     "`.example.com` (the domain and its subdomains), or `*` alone for any Host, behind a proxy "
                     "that checks it (default: none)",
    "max_connections": "open HTTP connections at once (keep-alive ones included); while more are open a request "
                       "gets 503 with Retry-After and its connection is closed",
    "max_streams": "streamed (SSE) responses open at once; one more gets 503 with Retry-After before it starts",
    "stream_interval": "a stream's tokens go out in runs of this many (the first at once, the last with the end): "
                       "fewer messages and wake-ups a token, at the price of a burstier stream; a request with "
                       "stop strings or stop_regex still goes token by token (whole results come in runs of 50)",
    "tp": "tensor-parallel ranks: runner processes that each hold 1/tp of every layer (torch.distributed); must "
          "divide the attention heads, the MLP width and the KV heads (or be a multiple of them)",
    "dp": "data-parallel replicas on this machine: each a scheduler with its own KV pool, radix cache and "
          "policies, and its runner rank(s); one api and tokenizer route requests to them (--routing-policy)",
    "routing_policy": "how --dp replicas share requests: {routing}, or a plugin's (entry points "
                      "radixserve.routing_policies); cache-aware sends requests sharing a prefix where it is cached",
    "nnodes": "machines the --tp ranks are spread over (tp / nnodes each); start `radixserve serve` on each with "
              "the same flags and its own --node-rank",
    "node_rank": "this machine's number, 0..nnodes-1; node 0 serves HTTP and runs the scheduler",
    "dist_init_addr": "HOST:PORT of node 0, reachable from every node: torch.distributed's store at PORT, the "
                      "scheduler's plans at PORT+1, the nodes' heartbeat link at PORT+2 (default: a free local "
                      "port, one machine)",
    "dist_backend": "auto: nccl on CUDA, gloo on the CPU",
    "dist_timeout": "seconds a collective may wait (also the rendezvous: start every node within it); a node "
                    "silent for 10 s, or this if shorter, ends the whole server",
    "dist_auth_key_file": "with --nnodes > 1: the nodes' shared secret key (CurveZMQ); node 0 creates it when "
                          "absent, copy it to the same path on every other node (mode 0600) (default: "
                          "$RADIXSERVE_CACHE/dist-auth.key, i.e. ~/.cache/radixserve/dist-auth.key)",
    "log_level": "log messages of this level and above",
    "num_threads": "torch threads for the model, fixed (default: the CPUs this process may use -- affinity and "
                   "cgroup quota -- shared by the ranks of this machine, fewer while other processes keep CPUs busy)",
    "device": "auto: cuda if torch sees a GPU, else cpu",
    "attention_backend": "auto: triton on cuda, torch on cpu, batch-invariant with --deterministic",
    "max_queued_requests": "sequences that may wait for a slot beyond the running ones; past it new requests get "
                           "429 with Retry-After. With --enable-priority-scheduling each scheduler keeps its queue "
                           "to this many by priority: a more important arrival drops the least important waiting "
                           "request (503), a less important one gets 429",
    "max_sequences_per_request": "prompts x n one HTTP request may ask for; past it: 429 (default: as many as "
                                 "the server holds in flight, --max-queued-requests + --max-running-requests)",
    "queue_timeout": "seconds a request may wait in the queue before it fails with 503 (default: no limit)",
    "shutdown_timeout": "seconds SIGTERM/SIGINT waits for requests in flight (new ones get 503) before stopping",
    "disable_overlap_schedule": "plan each decode step only after the step before it has returned; by default the "
                                "next decode step is planned while one computes and the runner goes straight on "
                                "(off anyway with --tp > 1 and with --random-seed)",
    "random_seed": "seeds the sampling noise of requests without a seed of their own, once at start: two servers "
                   "started with the same seed answer the same sequence of requests with the same tokens "
                   "(default: a fresh seed each start)",
    "deterministic": "batch-invariant inference: greedy and seeded tokens never depend on the batch (CPU; the docs' "
                     "performance page has its cost)",
    "quantization": "int8 (per output channel) or int4 (groups of 32) weight-only linear layers on the CPU, "
                    "a GGUF file's blocks in those sizes taken as they ship (int8: Q8_0, Q6_K, Q5_K; int4: Q4_0, "
                    "Q4_1, Q4_K); gguf: every layer of a GGUF file (Llama family) as it ships, Q4_K_M and Q5_K_M "
                    "files included (default: none: a GGUF file is dequantized to --dtype at load)",
    "decode_kernel": "how CPU decode steps (and short prefills) run: native (the whole step in one C++ call, built "
                     "for this CPU on first use; needs AVX2 (AVX-512 BF16 + VNNI used where present) and a C++ "
                     "compiler; bf16, float32 or "
                     "--quantization weights), compiled (torch.compile'd layers), eager; auto: native where it "
                     "can run, else compiled",
    "disable_compile": "run decode steps eagerly: no native step, no torch.compile graphs (compiling them at "
                       "start-up takes ~30 s the first time, a few seconds once cached; CPU only, never with "
                       "--deterministic)",
    "mem_fraction_static": "CUDA: the share of the GPU's memory for the weights and the KV pool; the pool gets what "
                           "the weights leave of it (default: 0.85)",
    "check_invariants": "check KV pool accounting after every step (slow; for debugging)",
}
SERVE = {"usage": "%(prog)s [--model-path PATH_OR_HUB_ID] [--host HOST] [--port PORT] [--tp N] [options]",
         "description": "Start the OpenAI-compatible (and SGLang-compatible) HTTP server",
         "allow_abbrev": True}  # its parser's wording; a flag's unique prefix is the flag, as SGLang's launcher takes


class ArgParser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2) and unknown flags named with the closest known flag.
    Abbreviations are off unless asked for (the server's parser takes them, as SGLang's does: ``--context-len``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", lambda prog: argparse.HelpFormatter(prog, max_help_position=36))
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001 (argparse's signature)
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen(namespace)
            parser.error(parser.unrecognized(extras))
        return namespace

    def error(self, message: str):  # noqa: ANN201 (never returns)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def unrecognized(self, extras: list[str]) -> str:
        known = [s for a in self._actions for s in a.option_strings]
        flags = [e.split("=", 1)[0] for e in extras if e.startswith("-")]
        if not flags:
            return f"unrecognized arguments: {' '.join(extras)} (every setting is a --flag; see --help)"
        return "; ".join(f"unrecognized argument {f}{did_you_mean(f, known, quote=False)}" for f in flags)

    def _chosen(self, namespace: argparse.Namespace) -> ArgParser:
        """The (sub)command parser the arguments went to: its flags are the ones a mistyped flag was meant as."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(namespace, action.dest, None) or "")
                if isinstance(sub, ArgParser):
                    return sub._chosen(namespace)
        return self


class Switch(argparse.BooleanOptionalAction):
    """``--flag`` / ``--no-flag``, help as written (Python 3.10-3.12 would append "(default: False)" again)."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, help=help, **kwargs)
        self.help = help


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerArgs field, in GROUPS' sections (a field in none lands in "other")."""
    hints = typing.get_type_hints(ServerArgs)
    placed = {name for names in GROUPS.values() for name in names}
    by_name = {f.name: f for f in fields(ServerArgs) if f.name not in RESOLVED}
    sections = {**GROUPS, "other": tuple(n for n in by_name if n not in placed)}
    policies = _policy_names()
    for title, names in sections.items():
        if not names:
            continue
        group = parser.add_argument_group(title)
        for name in names:
            f = by_name[name]
            flags = ["--" + name.replace("_", "-"), *ALIASES.get(name, [])]
            default = f.default if f.default is not MISSING else \
                f.default_factory() if f.default_factory is not MISSING else None
            text = HELP.get(name, "").format(**policies)
            kind, many = _scalar(hints[name])
            if kind is bool:
                group.add_argument(*flags, dest=name, action=Switch, default=default,
                                   help=_with_default(text, "on" if default else "off"))
                continue
            choices = CHOICES.get(name)
            if name in ("dtype", "kv_cache_dtype"):
                choices = (*choices, *DTYPE_ALIASES)
            elif name == "auto_policy_metric":
                from radixserve.lab.auto_policy import METRICS

                choices = tuple(METRICS)
            group.add_argument(*flags, dest=name, type=kind, default=default, choices=choices,
                               nargs="+" if many else None, metavar=METAVARS.get(name),
                               help=_with_default(text, None if default is None else default))


def from_cli(namespace: argparse.Namespace) -> ServerArgs:
    return ServerArgs(**{f.name: getattr(namespace, f.name) for f in fields(ServerArgs) if f.name not in RESOLVED})


def server_parser(prog: str = "radixserve serve") -> ArgParser:
    """``radixserve serve`` / ``python -m radixserve.launch_server``: the same flags."""
    parser = ArgParser(prog=prog, **SERVE)
    add_cli_args(parser)
    return parser


def _scalar(hint: Any) -> tuple[type, bool]:
    """The type argparse converts a field's values to, and whether it takes several (a tuple field)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    one = args[0]
    if typing.get_origin(one) is tuple:
        return typing.get_args(one)[0], True
    return one, False


def _with_default(text: str, default: Any) -> str:
    """The help with its default, unless the text already says what the default (or None) means."""
    if default is None or "(default:" in text:
        return text
    return f"{text} (default: {default})".lstrip()


def _policy_names() -> dict[str, str]:
    """The registered policy names (built-ins and installed plugins), for the help texts."""
    from radixserve.actors.router.policies import available as routing
    from radixserve.policies.registry import available
    from radixserve.tool_parsers import available as tool_parsers

    return {"eviction": ", ".join(available("eviction")), "schedule": ", ".join(available("schedule")),
            "routing": ", ".join(routing()), "tool_parsers": ", ".join(tool_parsers())}
