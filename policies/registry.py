"""Policies by name, through the entry-point groups a third-party package can add to.

    [project.entry-points."radixserve.eviction_policies"]
    my-policy = "my_package.module:MyPolicy"      # a class (or factory) called with no arguments
"""
from __future__ import annotations

from typing import Any, Literal

from radixserve.plugins import load_plugin, registered
from radixserve.policies.base import EvictionPolicy, SchedulePolicy

Kind = Literal["eviction", "schedule"]
GROUPS: dict[Kind, str] = {
    "eviction": "radixserve.eviction_policies",
    "schedule": "radixserve.schedule_policies",
}


def available(kind: Kind) -> list[str]:
    """Names registered for ``kind``, sorted."""
    return registered(GROUPS[kind])


def _load(kind: Kind, name: str) -> Any:
    return load_plugin(GROUPS[kind], name, f"{kind} policy", needs=("name", "key" if kind == "eviction" else "order"),
                       see="radixserve.policies.base")


def load_eviction_policy(name: str) -> EvictionPolicy:
    return _load("eviction", name)


def load_schedule_policy(name: str) -> SchedulePolicy:
    return _load("schedule", name)
