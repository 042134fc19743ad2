"""Speculative decoding, the scheduler's half: drafts for the decoding requests, and what a verified step keeps.

A decode step with drafts is an extend step: each request computes its last token and its draft, and the runner
returns the model's token after every one of those positions (``ForwardResult.drafted`` and the sampling row). For
a greedy request that is the argmax: the draft's tokens up to the first one the model disagrees with are the
model's own, and so is the token it computed after them, so a step keeps ``accepted + 1`` tokens, exactly what as
many plain greedy steps would have produced. A sampled request's check keeps each draft token with the model's
probability of it and draws the first refused one's replacement from the rest (speculative sampling,
``sampler.verify_draft``): each kept token has exactly the distribution a plain step samples from. The slots of
the rejected part go back (``CacheManager.truncate``), so only committed tokens reach the tree.

Only requests whose next token depends on the model's logits and their sampling parameters alone speculate: no
grammar, penalty, logit processor, logprobs or seed (a seeded request's tokens are a function of its seed, which
a draft would change); the others decode as before in the same step (a draft of 0 tokens). A request whose
draft was rejected outright drafts again only after 1, 2, 4 ... 64 plain steps (reset by an accepted token): a
source that keeps guessing wrong for it stops costing it verification. And a cost gate (``CostGate``) compares the
seconds per kept token of verifying steps with those of plain decode steps, per batch size, and turns drafting off
for a while where verifying does not pay.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from radixserve.actors.scheduler.req import Req
from radixserve.policies import load_draft_policy
from radixserve.policies.drafts import DraftCache, DraftOptions, DraftPolicy, NoCache, NoDrafts, accepted_prefix

log = logging.getLogger(__name__)


@dataclass
class DraftStats:
    """Totals since start (or the last switch of the draft policy)."""

    steps: int = 0  # verifying steps
    drafts: int = 0  # request drafts verified
    drafted: int = 0  # draft tokens
    accepted: int = 0  # draft tokens the model agreed with
    backed_off: int = 0  # drafts not asked for: their request's last draft was rejected outright

    def as_dict(self) -> dict[str, float]:
        return {**self.__dict__, "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted": self.accepted / self.drafts if self.drafts else 0.0}


def speculates(req: Req, sampled: bool = True) -> bool:
    """Is ``req``'s next token decided by the model's logits and its sampling parameters alone (and greedy, unless
    ``sampled``)?"""
    p = req.params
    return ((p.greedy or (sampled and p.seed is None)) and p.constraint is None and not p.penalized and p.custom_logit_processor is None
            and req.top_logprobs is None and not req.prefill_only)


@dataclass
class Backoff:
    """One request's drafting after rejected drafts: skip ``skip`` more decode steps; ``misses`` in a row."""

    misses: int = 0
    skip: int = 0


MAX_BACKOFF = 64  # plain steps at most between two drafts of a request whose drafts keep being rejected


def bucket(batch: int) -> int:
    """Batch sizes that cost alike: 1, 2, 3-4, 5-8, 9-16, ..."""
    return max(batch - 1, 0).bit_length()


@dataclass
class CostGate:
    """Does verifying pay at this batch size? Seconds per kept token of verifying steps (a moving average over at
    least ``samples`` of them) against plain decode steps' seconds per token, measured on the steps themselves.
    Where verifying is slower (by more than ``margin``), drafting is off for ``hold`` decode steps, then measured
    afresh; while drafting is on, every ``explore``-th decode step is a plain one, to keep the plain figure
    current."""

    margin: float = 0.99
    hold: int = 64
    explore: int = 32
    samples: int = 4
    alpha: float = 0.25  # weight of the newest step in the moving averages
    steps: int = 0
    plain: dict[int, float] = field(default_factory=dict)  # bucket -> seconds per token, plain decode steps
    verify: dict[int, list] = field(default_factory=dict)  # bucket -> [seconds per kept token, steps measured]
    off_until: dict[int, int] = field(default_factory=dict)  # bucket -> decode step drafting resumes at
    turned_off: int = 0  # times drafting was turned off at a batch size

    def allows(self, batch: int) -> bool:
        """Called once per decode step: may this step draft?"""
        self.steps += 1
        b = bucket(batch)
        if self.off_until.get(b, 0) > self.steps:
            return False
        if b not in self.verify or self.verify[b][1] < self.samples:  # verifying is being measured
            return True
        if b not in self.plain:  # ... and now a plain step
            return False
        return self.steps % self.explore != 0

    def timed(self, batch: int, seconds: float, tokens: int, verified: bool) -> None:
        """A decode step of ``batch`` requests took ``seconds`` and kept ``tokens``."""
        if tokens <= 0 or seconds <= 0:
            return
        b, per_token = bucket(batch), seconds / tokens
        if not verified:
            self.plain[b] = per_token if b not in self.plain else (1 - self.alpha) * self.plain[b] + \
                self.alpha * per_token
            return
        v = self.verify.setdefault(b, [per_token, 0])
        v[0], v[1] = (per_token if v[1] == 0 else (1 - self.alpha) * v[0] + self.alpha * per_token), v[1] + 1
        if v[1] >= self.samples and b in self.plain and v[0] * self.margin > self.plain[b]:
            self.turned_off += 1
            self.off_until[b] = self.steps + self.hold
            del self.verify[b]  # measured afresh after the hold


class Speculation:
    def __init__(self, policy: str, tokens: int, vocab_size: int, sampled: bool = True,
                 options: DraftOptions | None = None) -> None:
        """``policy``: the draft policy's name (``none``: off); ``tokens``: the most draft tokens per request;
        ``sampled``: sampled requests draft too (else greedy ones only); ``options``: for a policy that takes
        them (the draft model's path)."""
        self.tokens, self.vocab_size, self.sampled, self.options = tokens, vocab_size, sampled, options
        self.policy: DraftPolicy = self.load(policy)
        self.stats = DraftStats()
        self._bad_drafts = 0
        self._backoff: dict[str, Backoff] = {}  # by rid: requests whose last draft was rejected outright
        self.gate: CostGate | None = CostGate()  # None: draft on every decode step (tests of exactness)
        self.kept = 0  # tokens the last verifying step kept (all its requests')

    @property
    def on(self) -> bool:
        return self.tokens > 0 and self.policy.name != "none"

    def info(self) -> dict[str, object]:
        """GET /cache/stats' "speculative": the draft policy, the most tokens a draft has, the totals, and where
        the cost gate has drafting off now."""
        g = self.gate
        return {"draft_policy": self.policy.name, "draft_tokens": self.tokens, **self.stats.as_dict(),
                "gate_turned_off": g.turned_off if g else 0,
                "gate_off_batch_sizes": sorted(1 << b for b, until in g.off_until.items() if until > g.steps)
                if g else []}

    def timed(self, mode: str, drafts: object, batch: int, seconds: float) -> None:
        """A step's duration (the scheduler's caller measures it): decode steps feed the cost gate."""
        if not self.on or self.gate is None:
            return
        if drafts is not None:
            self.gate.timed(batch, seconds, self.kept, verified=True)
        elif mode == "decode":
            self.gate.timed(batch, seconds, batch, verified=False)

    def load(self, name: str) -> DraftPolicy:
        """The draft policy ``name`` built with this server's options (ValueError naming what is wrong)."""
        return NoDrafts() if name == "none" else load_draft_policy(name, self.options)  # off: no lookup

    def set_policy(self, policy: DraftPolicy) -> None:
        """Switch live (between two steps): the new policy starts with no per-request state."""
        self.policy = policy
        self.stats = DraftStats()
        self._backoff.clear()

    def propose(self, running: list[Req], room: int, cache: DraftCache | None) -> list[list[int]] | None:
        """Each running request's draft (empty where it does not speculate), using at most ``room`` slots beyond
        one a request; None when no request has one (a plain decode step)."""
        if not self.on or (self.gate is not None and not self.gate.allows(len(running))):
            return None
        view = cache if cache is not None else NoCache()
        drafts: list[list[int]] = []
        for req in running:
            want = min(self.tokens, req.max_new_tokens - len(req.output_ids) - 1, room)
            draft = self._draft(req, want, view) if want > 0 and speculates(req, self.sampled) and self._due(req.rid) else []
            room -= len(draft)
            drafts.append(draft)
        return drafts if any(drafts) else None

    def _due(self, rid: str) -> bool:
        """Is ``rid`` asked for a draft this step (not backing off after rejected drafts)?"""
        b = self._backoff.get(rid)
        if b is None or b.skip <= 0:
            return True
        b.skip -= 1
        self.stats.backed_off += 1
        return False

    def _draft(self, req: Req, want: int, cache: DraftCache) -> list[int]:
        try:
            draft = list(self.policy.propose(req.rid, req.fill_key, want, cache))[:want]
        except Exception:  # a plugin's bug costs its speed, never the request
            log.exception("draft policy %r failed; request %s decodes without a draft", self.policy.name, req.rid)
            return []
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in draft):
            self._bad_drafts += 1
            if self._bad_drafts == 1:
                log.error("draft policy %r proposed tokens outside the vocabulary (%s...); such drafts are dropped",
                          self.policy.name, draft[:4])
            return []
        return draft

    def accept(self, rid: str, draft: list[int], drafted: list[int], last: int) -> list[int]:
        """The tokens a verified step keeps: the draft's accepted prefix and the model's token after it."""
        model = [*drafted, last]
        n = accepted_prefix(draft, model)
        if n:
            self._backoff.pop(rid, None)
        else:
            b = self._backoff.setdefault(rid, Backoff())
            b.misses += 1
            b.skip = min(2 ** (b.misses - 1), MAX_BACKOFF)
        self.stats.drafts += 1
        self.stats.drafted += len(draft)
        self.stats.accepted += n
        return model[: n + 1]

    def release(self, req: Req) -> None:
        self._backoff.pop(req.rid, None)
        try:
            self.policy.release(req.rid, req.fill_key)
        except Exception:
            log.exception("draft policy %r failed releasing request %s", self.policy.name, req.rid)
