"""Speculative decoding, the scheduler's half: drafts for the decoding requests, and what a verified step keeps.

A decode step with drafts is an extend step: each request computes its last token and its draft, and the runner
checks the draft (``sampler.verify_tree``) and returns the draft tokens kept and the token after them
(``ForwardResult.drafted`` and the sampling row). For a greedy request the check follows the argmax: the draft's
tokens up to the first one the model disagrees with are the model's own, and so is the token it computed after
them, so a step keeps ``accepted + 1`` tokens, exactly what as many plain greedy steps would have produced. A
sampled request's check keeps each draft token with the model's probability of it and draws the first refused
one's replacement from the rest (speculative sampling): each kept token has exactly the distribution a plain step
samples from. A draft tree (``DraftTree``: ``suffix`` and ``radix`` with ``--speculative-draft-width`` above 1) is
checked the same way along the path the model's tokens walk, every branch in the same forward under a tree mask;
the kept path's slots move up behind the request's last token (``CacheManager.keep``). The slots of the rejected
part go back (``CacheManager.truncate``), so only committed tokens reach the tree.

Only requests whose next token depends on the model's logits and their sampling parameters alone speculate: no
grammar, penalty, logit processor, logprobs or seed (a seeded request's tokens are a function of its seed, which
a draft would change); the others decode as before in the same step (a draft of 0 tokens). A request whose
draft was rejected outright drafts again only after 1, 2, 4 ... 64 plain steps (reset by an accepted token): a
source that keeps guessing wrong for it stops costing it verification. And a cost model (``CostModel``), timed on
the steps themselves, says per batch size what a draft token costs in plain tokens; with a request's own
acceptance that decides how long its draft is (``draft_length``: the length that makes the most tokens per second,
longer the more of its drafts are kept). A request for which no length pays decodes plainly, while the policy's
drafts for it are still proposed and judged against the tokens it makes (what verifying them would have kept, at no
model cost), so it drafts again as soon as its drafts would pay. At a batch size where a draft token costs as much
as a plain token or more (large batches on a CPU), no draft pays: the policy is not asked at all.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.actors.scheduler.req import Req
from radixserve.policies import load_draft_policy
from radixserve.policies.draft_trees import DraftTree
from radixserve.policies.drafts import DraftCache, DraftOptions, DraftPolicy, NoCache, NoDrafts

log = logging.getLogger(__name__)


@dataclass
class DraftStats:
    """Totals since start (or the last switch of the draft policy)."""

    steps: int = 0  # verifying steps
    drafts: int = 0  # request drafts verified
    drafted: int = 0  # draft tokens
    accepted: int = 0  # draft tokens the model agreed with
    backed_off: int = 0  # drafts not asked for: their request's last draft was rejected outright
    not_worth: int = 0  # drafts not verified: their request's acceptance was below what a draft costs
    watched: int = 0  # drafts not verified but judged against the tokens that came (Drafting.watch)

    def as_dict(self) -> dict[str, float]:
        return {**self.__dict__, "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted": self.accepted / self.drafts if self.drafts else 0.0}


def speculates(req: Req, sampled: bool = True) -> bool:
    """Is ``req``'s next token decided by the model's logits and its sampling parameters alone (and greedy, unless
    ``sampled``)?"""
    p = req.params
    return ((p.greedy or (sampled and p.seed is None)) and p.constraint is None and not p.penalized
            and p.custom_logit_processor is None and req.top_logprobs is None and not req.prefill_only)


@dataclass
class Drafting:
    """One request's drafting record: its draft tokens kept and its refusals (a draft kept whole refuses none),
    as sums that fade by ``FADE`` a draft, so the newest drafts count most; its rejected-outright drafts in a row
    (``misses``) and the decode steps it still skips after them (``skip``); and ``watch``, a draft proposed but
    not verified (the cost model advised against it), judged against the tokens the request makes next (from
    ``watch_at`` on): what verifying it would have kept, learnt at no model cost."""

    kept: float = 0.0
    refused: float = 0.0
    misses: int = 0
    skip: int = 0
    watch: DraftTree | None = None
    watch_at: int = 0

    def acceptance(self, prior: float) -> float:
        """The chance that a draft token is kept when the ones before it were: kept / (kept + refused), with one
        draft's worth of ``prior`` (the policy's figure over all requests) mixed in, so that one unlucky draft
        does not settle a request's fate."""
        return (self.kept + PRIOR_WEIGHT * prior) / (self.kept + self.refused + PRIOR_WEIGHT)

    def count(self, kept: int, refused: bool) -> None:
        self.kept = FADE * self.kept + kept
        self.refused = FADE * self.refused + float(refused)

    def judge(self, tokens: Sequence[int]) -> bool:
        """Judge the watched draft by the tokens made since it was proposed, once they settle it (a token it got
        wrong, or all of it right). True when it was judged."""
        if self.watch is None:
            return False
        new = tokens[self.watch_at : self.watch_at + len(self.watch)]
        path = self.watch.walk(new)
        if self.watch.goes_on(path) and len(new) == len(path):
            return False  # right so far: wait for more tokens
        self.count(len(path), len(new) > len(path) and self.watch.goes_on(path))
        self.watch = None
        return True


def draft_length(acceptance: float, cost: float, most: int) -> int:
    """The draft length (0 .. ``most``) that makes the most tokens per second: with each draft token kept with
    probability ``acceptance`` when the ones before it were, a draft of k keeps a + a^2 + .. + a^k tokens on
    average beyond the one every step makes, and costs 1 + k ``cost`` plain steps (``cost``: a draft token's
    time, in plain tokens). 0 where no length beats a plain step by ``MARGIN``."""
    best, best_rate, kept = 0, 1.0 + MARGIN, 0.0
    for k in range(1, most + 1):
        kept += acceptance ** k
        rate = (1 + kept) / (1 + k * cost)
        if rate > best_rate + 1e-9:
            best, best_rate = k, rate
    return best


MARGIN = 0.05  # a draft must promise this much more than a plain step: its cost and acceptance are estimates
MAX_BACKOFF = 64  # plain steps at most between two drafts of a request whose drafts keep being rejected
ALPHA = 0.3  # weight of the newest figure in the cost model's moving averages
FADE = 0.7  # a request's drafting sums fade by this a draft
PRIOR_WEIGHT = 1.0  # how many of its own drafts the policy-wide acceptance counts as, in a request's


def bucket(batch: int) -> int:
    """Batch sizes that cost alike: 1, 2, 3-4, 5-8, 9-16, ..."""
    return max(batch - 1, 0).bit_length()


def average(old: float | None, new: float, alpha: float = ALPHA) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


@dataclass
class CostModel:
    """Does a draft pay, at this batch size and for this request? Measured on the steps themselves, per batch-size
    bucket: ``plain[b]``, a plain decode step's seconds, and ``per_draft[b]``, what a verifying step costs beyond
    a plain one per draft token. A plain step of B requests makes B tokens in P seconds; verifying D draft tokens
    adds c D seconds and gains the tokens kept, so it pays when a draft token is kept more often than
    c / (P / B): what it costs, in plain tokens (``draft_cost``). Large batches make P / B small and raise the
    bar; a request drafts while its own acceptance is above it. Until a batch size's figures are measured, its
    steps are measured: one plain step first, then drafts; while drafting, every ``explore``-th decode step is
    plain, to keep P current."""

    explore: int = 32
    steps: int = 0
    plain: dict[int, float] = field(default_factory=dict)  # bucket -> seconds of a plain decode step
    per_draft: dict[int, float] = field(default_factory=dict)  # bucket -> seconds a draft token adds to a step

    def allows(self, batch: int) -> bool:
        """Called once per decode step: may this step draft (False: a plain step, measured)?"""
        self.steps += 1
        return bucket(batch) in self.plain and self.steps % self.explore != 0

    def draft_cost(self, batch: int) -> float:
        """A draft token's cost in plain tokens at this batch size, which is the acceptance a one-token draft
        needs to pay. While it is being measured, the largest smaller batch size's seconds a draft token stand in
        (they only grow with the batch: a lower bound); 0 where none is measured."""
        b = bucket(batch)
        known = [m for m in self.per_draft if m <= b]
        if not known or b not in self.plain:
            return 0.0
        return self.per_draft[max(known)] / (self.plain[b] / batch)

    def timed(self, batch: int, seconds: float, drafted: int) -> None:
        """A decode step of ``batch`` requests that verified ``drafted`` draft tokens (0: a plain one) took
        ``seconds``."""
        b = bucket(batch)
        if drafted == 0:
            self.plain[b] = average(self.plain.get(b), seconds)
        elif b in self.plain:
            sample, old = max(seconds - self.plain[b], 0.0) / drafted, self.per_draft.get(b)
            # one slow step (a busy neighbour, a first shape) moves the figure at most as far as a doubling would
            self.per_draft[b] = average(old, sample if old is None else min(sample, 2 * old))

    def recheck(self) -> bool:
        """Where a draft token costs a plain one or more, is this the step (one in ``explore``) that verifies
        one-token drafts all the same, to measure that cost again (else one slow step would stop drafting at
        that batch size for good)?"""
        return self.steps % self.explore == self.explore // 2

    def info(self) -> dict[str, dict[str, float]]:
        """Per batch size measured (the bucket's largest): the figures and the acceptance a draft needs."""
        return {str(1 << b): {"plain_step_s": self.plain[b], "per_draft_token_s": self.per_draft[b],
                              "acceptance_needed": self.draft_cost(1 << b)}
                for b in sorted(self.per_draft) if b in self.plain}


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
        self._requests: dict[str, Drafting] = {}  # by rid: the running requests that drafted or were asked to
        self.gate: CostModel | None = CostModel()  # None: draft on every decode step (tests of exactness)
        self.kept = 0  # tokens the last verifying step kept (all its requests')

    @property
    def on(self) -> bool:
        return self.tokens > 0 and self.policy.name != "none"

    def info(self) -> dict[str, object]:
        """GET /cache/stats' "speculative": the draft policy, the most tokens a draft has, the totals, and the cost
        model's figures per batch size."""
        return {"draft_policy": self.policy.name, "draft_tokens": self.tokens,
                "draft_width": self.options.width if self.options is not None else 1, **self.stats.as_dict(),
                "cost": self.gate.info() if self.gate is not None else {}}

    def timed(self, mode: str, drafts: object, batch: int, seconds: float) -> None:
        """A step's duration (the scheduler's caller measures it; ``drafts``: the plan's draft lengths): decode
        steps feed the cost model."""
        if not self.on or self.gate is None:
            return
        if drafts is not None:
            self.gate.timed(batch, seconds, int(sum(drafts)))
        elif mode == "decode":
            self.gate.timed(batch, seconds, 0)

    def load(self, name: str) -> DraftPolicy:
        """The draft policy ``name`` built with this server's options (ValueError naming what is wrong)."""
        return NoDrafts() if name == "none" else load_draft_policy(name, self.options)  # off: no lookup

    def set_policy(self, policy: DraftPolicy) -> None:
        """Switch live (between two steps): the new policy starts with no per-request state."""
        self.policy = policy
        self.stats = DraftStats()
        self._requests.clear()

    def propose(self, running: list[Req], room: int, cache: DraftCache | None) -> list[DraftTree] | None:
        """Each running request's draft (empty where it does not speculate), using at most ``room`` slots beyond
        one a request; None when no request has one (a plain decode step)."""
        if not self.on or (self.gate is not None and not self.gate.allows(len(running))):
            return None
        cost = self.gate.draft_cost(len(running)) if self.gate is not None else 0.0
        most = self.tokens
        if cost >= 1.0:  # a draft token costs a plain token or more here: no acceptance pays, nothing to ask ...
            if not self.gate.recheck():
                return None
            cost, most = 0.0, 1  # ... but on a recheck step: one-token drafts, to measure the cost again
        view = cache if cache is not None else NoCache()
        drafts: list[DraftTree] = []
        for req in running:
            want = min(most, req.max_new_tokens - len(req.output_ids) - 1, room)
            draft = self._due(req, cost, want, view) if want > 0 and speculates(req, self.sampled) else DraftTree()
            room -= len(draft)
            drafts.append(draft)
        return drafts if any(drafts) else None

    def _due(self, req: Req, cost: float, most: int, cache: DraftCache) -> DraftTree:
        """``req``'s draft this step (at most ``most`` tokens): none while it backs off after rejected drafts;
        else as long as pays best at its acceptance and this batch's ``cost`` of a draft token. Where no length
        pays, the policy's draft is watched instead of verified (``Drafting.watch``): the request's acceptance
        keeps being measured, for free, and it drafts again once its drafts would pay."""
        r = self._requests.setdefault(req.rid, Drafting())
        if r.judge(req.fill_key):
            self.stats.watched += 1
        if r.skip > 0:
            r.skip -= 1
            self.stats.backed_off += 1
            return DraftTree()
        prior = self.stats.accepted / self.stats.drafted if self.stats.drafted else 1.0
        length = draft_length(r.acceptance(prior), cost, most) if self.gate is not None else most
        if length > 0:
            r.watch = None  # a verified draft is judged by accept()
            return self._draft(req, length, cache)
        self.stats.not_worth += 1
        if r.watch is None:
            r.watch, r.watch_at = self._draft(req, most, cache) or None, len(req.fill_key)
        return DraftTree()

    def _draft(self, req: Req, want: int, cache: DraftCache) -> DraftTree:
        try:
            got = self.policy.propose(req.rid, req.fill_key, want, cache)
            draft = got[:want] if isinstance(got, DraftTree) else DraftTree(list(got)[:want])
        except Exception:  # a plugin's bug costs its speed, never the request
            log.exception("draft policy %r failed; request %s decodes without a draft", self.policy.name, req.rid)
            return DraftTree()
        problem = draft.problem() or next((f"token {t!r} is outside the vocabulary" for t in draft
                                           if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if problem is not None:
            self._bad_drafts += 1
            if self._bad_drafts == 1:
                log.error("draft policy %r proposed a draft that is not one (%s); such drafts are dropped",
                          self.policy.name, problem)
            return DraftTree()
        return draft

    def accept(self, rid: str, draft: DraftTree, drafted: list[int], last: int) -> tuple[list[int], list[int]]:
        """What a verified step keeps: (the tokens: the draft's path the model's tokens walk and the model's token
        after it; that path, as the draft's token indices)."""
        model = [*drafted, last]
        path = draft.walk(model)
        n = len(path)
        r = self._requests.setdefault(rid, Drafting())
        r.count(n, draft.goes_on(path))
        if n:
            r.misses = 0
        else:
            r.misses += 1
            r.skip = min(2 ** (r.misses - 1), MAX_BACKOFF)
        self.stats.drafts += 1
        self.stats.drafted += len(draft)
        self.stats.accepted += n
        return model[: n + 1], path

    def release(self, req: Req) -> None:
        self._requests.pop(req.rid, None)
        try:
            self.policy.release(req.rid, req.fill_key)
        except Exception:
            log.exception("draft policy %r failed releasing request %s", self.policy.name, req.rid)
