"""Policies by name, through the entry-point groups a third-party package can add to.

    [project.entry-points."radixserve.eviction_policies"]
    my-policy = "my_package.module:MyPolicy"      # a class (or factory) called with no arguments
"""
from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, Literal

from radixserve.errors import did_you_mean
from radixserve.policies.base import EvictionPolicy, SchedulePolicy

Kind = Literal["eviction", "schedule"]
GROUPS: dict[Kind, str] = {
    "eviction": "radixserve.eviction_policies",
    "schedule": "radixserve.schedule_policies",
}


def available(kind: Kind) -> list[str]:
    """Names registered for ``kind``, sorted."""
    return sorted({ep.name for ep in entry_points(group=GROUPS[kind])})


def _load(kind: Kind, name: str) -> Any:
    matches = [ep for ep in entry_points(group=GROUPS[kind]) if ep.name == name]
    if not matches:
        names = available(kind)
        raise ValueError(f"unknown {kind} policy {name!r}; available: {', '.join(names) or 'none'}"
                         f"{did_you_mean(name, names)}")
    ep = matches[0]
    try:
        factory = ep.load()
        policy = factory()
    except Exception as exc:  # a plugin's own bug: name it, keep the caller running
        raise ValueError(f"{kind} policy {name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}") from exc
    for attr in ("name", "key" if kind == "eviction" else "order"):
        if not hasattr(policy, attr):
            raise ValueError(f"{kind} policy {name!r} ({ep.value}) has no {attr!r}; see radixserve.policies.base")
    return policy


def load_eviction_policy(name: str) -> EvictionPolicy:
    return _load("eviction", name)


def load_schedule_policy(name: str) -> SchedulePolicy:
    return _load("schedule", name)
