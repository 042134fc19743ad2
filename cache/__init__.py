"""KV-slot bookkeeping (no torch): allocator, radix tree, cache manager."""
from radixserve.cache.allocator import DUMMY_SLOT, SLOT_DTYPE, SlotAllocator
from radixserve.cache.manager import CacheManager, KVHandle
from radixserve.cache.radix_tree import RadixTree, TreeNode

__all__ = ["DUMMY_SLOT", "SLOT_DTYPE", "CacheManager", "KVHandle", "RadixTree", "SlotAllocator", "TreeNode"]
