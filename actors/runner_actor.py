"""The runner actor: receives a ForwardPlan, runs it, replies with the ForwardResult. Nothing else."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from radixserve.actors.messages import RunnerInbox
from radixserve.actors.transport import ActorSpec, Channel, run_actor


class RunnerActor:
    def __init__(self, runner, channel: Channel) -> None:
        self.runner = runner
        self.channel = channel

    async def run(self) -> None:
        while True:
            plan = await self.channel.recv()
            await self.channel.send("scheduler", self.runner.forward(plan))


def build(spec: ActorSpec, channel: Channel) -> tuple[RunnerActor, dict[str, Any]]:
    from radixserve.model.config import ModelConfig
    from radixserve.model.loader import load_configs
    from radixserve.model.runner import ModelRunner

    args = spec.server_args
    cfg = ModelConfig.from_hf(*load_configs(Path(spec.model_dir)))
    source = Path(spec.model_source) if spec.model_source else None
    runner = ModelRunner.from_args(cfg, Path(spec.model_dir), args, source)
    return RunnerActor(runner, channel), {"dtype": args.dtype, "device": args.device, "attention": runner.attn.name,
                                          "deterministic": args.deterministic, "quantization": args.quantization,
                                          "decode_kernel": runner.decode_kernel,
                                          "kv_pool_bytes": runner.kv.nbytes}


def main(spec: ActorSpec) -> None:
    run_actor("runner", spec, RunnerInbox, ("scheduler",), build)
