"""Eviction, scheduling, KV-tier and draft policies (no torch). Looked up by name through entry points; see registry."""
from radixserve.policies.base import CacheView, EvictionPolicy, NodeView, SchedulePolicy, WaitingRequest
from radixserve.policies.registry import (
    available, load_draft_policy, load_eviction_policy, load_prefetch_policy, load_schedule_policy,
    load_write_policy
)

__all__ = [
    "CacheView",
    "EvictionPolicy",
    "NodeView",
    "SchedulePolicy",
    "WaitingRequest",
    "available",
    "load_draft_policy",
    "load_eviction_policy",
    "load_prefetch_policy",
    "load_schedule_policy",
    "load_write_policy",
]
