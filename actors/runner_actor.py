"""The runner actor, one per tensor-parallel rank: receives every ForwardPlan the scheduler publishes, runs its
share of it; rank 0 samples and replies with the ForwardResult. Nothing else.

Rank 0 samples and the others do not, rather than every rank sampling the same way from the same seeds: only
rank 0 needs the whole logits (one gather instead of an all-gather), grammar state and sampling live in one
process, and no broadcast of the chosen ids is needed at all -- they come back to every rank inside the next
plan, which the scheduler publishes to all of them anyway.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from radixserve.actors.transport import ActorSpec, Channel, run_actor
from radixserve.cpu_budget import read_budget, wait_policy
from radixserve.wire.codec import encoder
from radixserve.wire.plans import Prefetched, RunnerInbox


def rank_name(rank: int) -> str:
    """The actor name of tensor-parallel rank ``rank`` ("runner" for rank 0, the one the scheduler hears from)."""
    return "runner" if rank == 0 else f"runner{rank}"


class RunnerActor:
    def __init__(self, runner, channel: Channel, scheduler: str = "scheduler") -> None:
        self.runner = runner
        self.channel = channel
        self.scheduler = scheduler  # its replica's

    async def run(self) -> None:
        while True:
            plan = await self.channel.recv()
            result = self.runner.forward(plan)
            if result is not None:  # rank 0
                await self.channel.send(self.scheduler, result)


def tier_reporter(address: str) -> Callable[[Prefetched], None]:
    """How the runner's KV-tier thread answers a read-back: on a socket of its own, to the scheduler's inbox, at
    once (the actor's loop may be in the middle of a step)."""
    encode = encoder().encode
    sock = None

    def report(msg: Prefetched) -> None:  # only ever called from that one thread
        nonlocal sock
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        sock.send(encode(msg))

    return report


def seed_sampling(seed: int | None) -> None:
    """``--random-seed``: requests without a seed of their own draw their sampling noise from torch's default
    generators; seeded once the model is built (whatever its warm-up drew), two servers started alike answer the
    same sequence of requests with the same tokens. None: torch's own fresh seed."""
    if seed is not None:
        import torch

        torch.manual_seed(seed)  # the CPU's and every CUDA device's generator


def build(spec: ActorSpec, channel: Channel, rank: int) -> tuple[RunnerActor, dict[str, Any]]:
    import dataclasses

    import torch

    from radixserve.model.config import ModelConfig
    from radixserve.model.loader import load_configs
    from radixserve.model.parallel import init_group
    from radixserve.model.runner import ModelRunner

    args = spec.server_args
    local = len(args.ranks_here) * args.dp
    # this node's CPUs, shared by its ranks (of every replica) and the other actors: at most this many threads
    max_threads = read_budget().threads(local, actors_beside=True) if args.num_threads is None else None
    if args.device.startswith("cuda") and args.tp > 1:  # a GPU of its own: this node's ranks take GPUs 0, 1, ..
        index = rank - args.ranks_here.start
        torch.cuda.set_device(index)
        args = dataclasses.replace(args, device=f"cuda:{index}")
    tp = init_group(rank, args.tp, args.dist_backend, spec.dist_addr, args.dist_timeout, args.device)
    # the pool is as large as node 0's scheduler made its allocator (another node sized it from its own memory)
    args = dataclasses.replace(args, max_total_tokens=tp.first_ranks(args.max_total_tokens))
    cfg = ModelConfig.from_hf(*load_configs(Path(spec.model_dir)))
    source = Path(spec.model_source) if spec.model_source else None
    # the launcher and the actors it started (this one's siblings) are the server itself, not a neighbour
    runner = ModelRunner.from_args(cfg, Path(spec.model_dir), args, source, tp, max_threads, os.getppid())
    seed_sampling(args.random_seed)
    if spec.scheduler_config.tiers is not None:  # read-backs come to its own thread, answers go from there
        runner.attach_tiers(args, spec.scheduler_config.tiers,
                            tier_reporter(spec.endpoints.address(spec.named("scheduler"))))
        runner.tiers.listen(spec.endpoints.address(spec.named("tiers")))
    return RunnerActor(runner, channel, spec.named("scheduler")), {
                                          "threads": torch.get_num_threads(), "omp_wait": wait_policy(os.environ),
                                          "adaptive_threads": runner.threads is not None and runner.threads.adaptive is not None,
                                          "rank": rank, "node": args.node_rank, "replica": spec.replica or 0,
                                          "dtype": args.dtype,
                                          "device": args.device, "attention": runner.attn.name,
                                          "deterministic": args.deterministic, "quantization": args.quantization,
                                          "decode_kernel": runner.decode_kernel, "decode_refused": runner.decode_refused,
                                          "kv_heads": runner.num_kv_heads,
                                          "kv_pool_bytes": runner.kv.nbytes}


def main(spec: ActorSpec, rank: int = 0) -> None:
    peers = (spec.named("scheduler"),) if rank == 0 else ()  # only rank 0 answers (and it runs on node 0)
    run_actor(spec.named(rank_name(rank)), spec, RunnerInbox, peers, lambda s, c: build(s, c, rank),
              subscribe=spec.endpoints.plans_source(spec.server_args.node_rank, spec.named("plans")))
