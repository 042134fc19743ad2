"""Start the server: ``python -m radixserve.launch_server [flags]`` (same flags as ``radixserve serve``).

The main process is the launcher/supervisor and the api actor (aiohttp on uvloop); tokenizer, scheduler and
the runner ranks are child processes. Any actor dying ends the server with a non-zero exit; SIGINT/SIGTERM end it
cleanly. On another node of a multi-node server (``--node-rank`` > 0) the main process only launches and
watches that node's ranks.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

from radixserve import __version__
from radixserve.cli_args import from_cli, server_parser
from radixserve.server_args import ServerArgs

if TYPE_CHECKING:
    from radixserve.actors.api.boundary import Boundary

log = logging.getLogger("radixserve")
SUPERVISE_INTERVAL_S = 0.25


def serve(args: ServerArgs) -> int:
    """Run until a signal (exit 0) or an actor's death (exit 1). Raises ValueError/FileNotFoundError early."""
    import uvloop

    from radixserve.actors.launcher import Launcher
    from radixserve.prepare import prepare

    boundary: Boundary | None = None  # node 0's HTTP server alone has one
    if args.node_rank == 0:  # before the model loads: a bad key file fails in a moment
        from radixserve.actors.api.boundary import boundary_from_flags

        boundary = boundary_from_flags(args.host, args.allowed_hosts, args.max_connections, args.api_key,
                                       args.api_key_file, os.environ)
    prepared = prepare(args)
    launcher = Launcher(prepared)
    launcher.start()
    reason = "stopped"
    try:
        code = uvloop.run(_serve(prepared, launcher, boundary) if boundary is not None else _serve_ranks(launcher))
        reason = "stopped" if code == 0 else launcher.failure() or f"exit code {code}"
        return code
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        launcher.shutdown(reason)
        log.info("stopped")


async def _serve_ranks(launcher) -> int:
    """Another node: its ranks run until a signal (0) or until a rank here dies or another node ends (1)."""
    stop = _stop_on_signals()
    log.info("node %d: ranks %s ready, serving node 0's scheduler", launcher.prepared.args.node_rank,
             list(launcher.ranks.values()))
    return await _supervise(launcher, None, stop, {})


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _serve(prepared, launcher, boundary: Boundary) -> int:
    from aiohttp import web

    from radixserve.actors.api.app import make_app
    from radixserve.actors.api.server import ApiServer, Limits

    args = prepared.args
    info = {
        "version": __version__,
        "model": prepared.model_name,
        "served_model_names": list(prepared.model_names),  # any of them is served; "model" (the first) is named
        "model_path": prepared.files.given,
        "context_length": args.context_length,
        "vocab_size": prepared.model.vocab_size,
        "max_total_tokens": args.max_total_tokens,
        "started": int(time.time()),
        "server_args": {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"},
        "actors": {name: {k: v for k, v in a.items() if k != "chat_template"} for name, a in launcher.info.items()},
        "ranks": {str(node): ranks for node, ranks in launcher.ranks_by_node().items()},  # per node
        "tp_ranks": args.tp,
        "model_info": prepared.model_info(launcher.info.get("tokenizer", {}).get("chat_template")),
        "tool_call_parser": launcher.info.get("tokenizer", {}).get("tool_call_parser"),  # --tool-call-parser, resolved
        "runtime_dir": launcher.runtime_dir,
    }
    in_flight = args.max_queued_requests + args.max_running_requests
    if args.enable_priority_scheduling:  # every scheduler keeps its own queue by priority: the api lets it judge
        in_flight = args.dp * in_flight + args.max_queued_requests  # and one more queue's worth of arrivals
    limits = Limits(max_sequences_per_request=args.max_sequences_per_request, max_in_flight=in_flight,
                    vocab_size=prepared.model.vocab_size, max_streams=args.max_streams)
    from radixserve.actors.tokenizer_actor import scheduler_names

    server = ApiServer(launcher.endpoints, info, limits, tuple(scheduler_names(args.dp)))
    server.metrics.ranks(launcher.ranks_by_node())
    server.start()
    runner = web.AppRunner(make_app(server, boundary), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        await runner.cleanup()
        await server.close()
        return 2
    log.info("radixserve %s serving %s on http://%s:%d", __version__, prepared.model_name, args.host, args.port)
    stop = _stop_on_signals()
    code = await _supervise(launcher, server, stop, info)
    if code == 0 and server.pending:  # a signal: drain -- new requests get 503, those in flight may finish
        log.info("draining %d request(s) for up to %gs (signal again to stop now)", len(server.pending),
                 args.shutdown_timeout)
        stop.clear()
        idle = server.drain()
        deadline = time.monotonic() + args.shutdown_timeout
        # the supervision goes on meanwhile: other nodes keep hearing from this one, a death ends the drain
        while not (idle.is_set() or stop.is_set()) and time.monotonic() < deadline:
            reason = launcher.failure()
            if reason:
                log.error("%s -- stopping the drain", reason)
                server.fail_all(f"{reason}; the server is shutting down")
                code = 1
                break
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
    await runner.cleanup()
    await server.close()
    return code


async def _supervise(launcher, server, stop: asyncio.Event, info: dict) -> int:
    """Until a signal (0) or an actor's death here or another node's end (1, every waiting request answered
    503). ``server``: the api (None on a node that runs only ranks)."""
    while not stop.is_set():
        reason = launcher.failure()
        if reason:
            log.error("%s -- shutting down", reason)
            info["unhealthy_reason"] = reason
            if server is not None:
                server.fail_all(f"{reason}; the server is shutting down")
                await asyncio.sleep(SUPERVISE_INTERVAL_S)  # let waiting handlers answer 503
            return 1
        try:
            await asyncio.wait_for(stop.wait(), SUPERVISE_INTERVAL_S)
        except asyncio.TimeoutError:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(server_parser().parse_args(argv))


def run_cli(namespace: argparse.Namespace) -> int:
    logging.basicConfig(level=namespace.log_level.upper(), format="%(asctime)s [api] %(name)s: %(message)s")
    try:
        return serve(from_cli(namespace))
    except (ValueError, FileNotFoundError, PermissionError) as exc:  # PermissionError: the nodes' key file
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # LaunchError: an actor failed to start
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
