"""Policies by name, through the entry-point groups a third-party package can add to.

    [project.entry-points."radixserve.eviction_policies"]
    my-policy = "my_package.module:MyPolicy"      # a class (or factory) called with no arguments
"""
from __future__ import annotations

from typing import Any, Literal

from radixserve.plugins import load_plugin, registered
from radixserve.policies.base import EvictionPolicy, SchedulePolicy
from radixserve.policies.drafts import DraftOptions, DraftPolicy
from radixserve.policies.tiers import PrefetchPolicy, WritePolicy

Kind = Literal["eviction", "schedule", "write", "prefetch", "draft"]
GROUPS: dict[Kind, str] = {
    "eviction": "radixserve.eviction_policies",
    "schedule": "radixserve.schedule_policies",
    "write": "radixserve.write_policies",  # the lower KV tiers' (policies/tiers.py)
    "prefetch": "radixserve.prefetch_policies",
    "draft": "radixserve.draft_policies",  # speculative decoding's draft sources (policies/drafts.py)
}
NEEDS: dict[Kind, tuple[str, ...]] = {
    "eviction": ("name", "key"),
    "schedule": ("name", "order"),
    "write": ("name", "on_insert", "on_hit", "on_evict"),
    "prefetch": ("name", "ready"),
    "draft": ("name", "propose", "release"),
}


def available(kind: Kind) -> list[str]:
    """Names registered for ``kind``, sorted."""
    return registered(GROUPS[kind])


def _load(kind: Kind, name: str, offered: dict[str, Any] | None = None) -> Any:
    see = {"write": "radixserve.policies.tiers", "prefetch": "radixserve.policies.tiers",
           "draft": "radixserve.policies.drafts"}.get(kind, "radixserve.policies.base")
    return load_plugin(GROUPS[kind], name, f"{kind} policy", needs=NEEDS[kind], see=see, offered=offered)


def load_eviction_policy(name: str) -> EvictionPolicy:
    return _load("eviction", name)


def load_schedule_policy(name: str) -> SchedulePolicy:
    return _load("schedule", name)


def load_write_policy(name: str) -> WritePolicy:
    return _load("write", name)


def load_prefetch_policy(name: str) -> PrefetchPolicy:
    return _load("prefetch", name)


def load_draft_policy(name: str, options: DraftOptions | None = None) -> DraftPolicy:
    """A policy whose constructor takes ``options`` gets these (the draft model's path, ...)."""
    return _load("draft", name, {"options": options or DraftOptions()})
