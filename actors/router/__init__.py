"""Data-parallel routing: policies that pick a worker for each request (round-robin, least-load, cache-aware
over an approximate radix tree of what each worker was sent), pluggable by entry point."""
from radixserve.actors.router.policies import (
    CacheAware, LeastLoad, RoundRobin, RoutingConfig, RoutingPolicy, Worker, available, load_routing_policy,
)
from radixserve.actors.router.tree import ApproxTree

__all__ = ["ApproxTree", "CacheAware", "LeastLoad", "RoundRobin", "RoutingConfig", "RoutingPolicy", "Worker",
           "available", "load_routing_policy"]
