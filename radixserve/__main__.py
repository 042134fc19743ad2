"""Command line: ``radixserve serve [flags]`` starts the OpenAI-compatible server; ``radixserve router
--worker-urls URL ...`` routes requests over several servers (actors/router/server.py); ``radixserve demo [flags]``
runs the offline Engine on the bundled model: a chat in the terminal (or, without a terminal, a short
scripted conversation), printing after each answer how many prompt tokens came from the radix cache.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from radixserve.cli_args import SERVE, ArgParser, add_cli_args, from_cli

SCRIPT = ["What is the capital of France?", "And what is it famous for?", "Say that again in one sentence."]


def demo(args: argparse.Namespace) -> int:
    from radixserve.engine import Engine

    with Engine(**vars(from_cli(args))) as engine:
        messages: list[dict[str, str]] = []
        interactive = sys.stdin.isatty()
        lines = iter(SCRIPT) if not interactive else None
        print("radixserve demo: chat with the model (empty line or Ctrl-D to quit)\n")
        while True:
            try:
                text = input("you> ") if interactive else next(lines)
            except (EOFError, StopIteration):
                break
            if not text.strip():
                break
            if not interactive:
                print(f"you> {text}")
            messages.append({"role": "user", "content": text})
            start = time.perf_counter()
            out = engine.chat(messages, {"temperature": 0, "max_new_tokens": args.max_new_tokens})
            took = time.perf_counter() - start
            meta = out["meta_info"]
            print(f"bot> {out['text']}")
            print(f"     [{meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens from the radix cache, "
                  f"{meta['completion_tokens']} generated in {took:.2f}s]\n")
            messages.append({"role": "assistant", "content": out["text"]})
    return 0


def build_parser() -> ArgParser:
    """The command line: serve, compare, router, demo (docs/hooks.py writes the flag reference from it)."""
    parser = ArgParser(prog="radixserve", description="A readable LLM serving engine (RadixAttention)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server", **SERVE)
    add_cli_args(p_serve)
    p_compare = sub.add_parser("compare", help="compare eviction/schedule policies (simulated and/or live)",
                               description="Compare policy pairs on one workload; see radixserve.lab.cli")
    from radixserve.lab.cli import add_args as add_compare_args

    add_compare_args(p_compare)
    p_router = sub.add_parser("router", help="route requests over several servers (cache-aware by default)",
                              description="One HTTP front for several radixserve or SGLang-compatible servers")
    from radixserve.actors.router.server import add_cli_args as add_router_args

    add_router_args(p_router)
    p_demo = sub.add_parser("demo", help="chat with the offline Engine in the terminal")
    p_demo.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default: 128)")
    add_cli_args(p_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from radixserve.launch_server import run_cli

        return run_cli(args)
    if args.command == "router":
        from radixserve.actors.router.server import run_cli as run_router

        return run_router(args)
    if args.command == "compare":
        from radixserve.lab.cli import run

        try:
            return run(args)
        except (ValueError, FileNotFoundError) as exc:
            print(f"radixserve compare: error: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(), format="%(asctime)s %(name)s: %(message)s")
    try:
        return demo(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
