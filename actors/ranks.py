"""The tensor-parallel runner ranks as processes behind an in-process scheduler (``Engine(tp=N)``, N > 1): the
same runner actors the server runs, launched and watched by the same Launcher; ``forward(plan)`` publishes the
plan to every rank, as the scheduler actor does, and returns rank 0's result."""
from __future__ import annotations

import zmq

from radixserve.actors.launcher import Launcher
from radixserve.actors.transport import Publisher
from radixserve.prepare import Prepared
from radixserve.wire.codec import decoder
from radixserve.wire.plans import ForwardPlan, ForwardResult

POLL_MS = 250


class Ranks:
    def __init__(self, prepared: Prepared) -> None:
        args = prepared.args
        self.launcher = Launcher(prepared, core=False)
        endpoints = self.launcher.endpoints
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.PULL)  # where rank 0 answers: the scheduler's address
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.bind(endpoints.address("scheduler"))
        self.plans = Publisher(endpoints.plans_bound())
        self._decoder = decoder(ForwardResult)
        try:
            self.launcher.start()
            self.plans.wait_for(args.tp, args.dist_timeout)
        except BaseException:
            self.shutdown()
            raise

    @property
    def decode_kernel(self) -> str:
        return self.launcher.info["runner"]["decode_kernel"]

    def forward(self, plan: ForwardPlan) -> ForwardResult:
        """The step's result from rank 0; RuntimeError if a rank ended meanwhile."""
        self.plans.send(plan)
        while True:
            if self.results.poll(POLL_MS):
                result = self._decoder.decode(self.results.recv())
                if result.step == plan.step:  # (an interrupted step's late answer is dropped)
                    return result
                continue
            reason = self.launcher.failure()
            if reason:
                raise RuntimeError(f"tensor parallelism: {reason}")

    def shutdown(self) -> None:
        self.launcher.shutdown()
        self.plans.close()
        self.results.close()
        self.ctx.term()
