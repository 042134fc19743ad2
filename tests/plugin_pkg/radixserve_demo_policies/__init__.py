"""Demo policies: two that work, two with bugs (to show a broken plugin cannot take the server down)."""


class LargestFirst:
    """Evict the segment that frees the most slots first."""

    name = "demo-largest-first"

    def key(self, node, now):
        return (-node.num_tokens, node.last_access)


class ShortestPromptFirst:
    """Admit short prompts first."""

    name = "demo-shortest-first"
    cache_aware = False

    def order(self, waiting, cache, now):
        return sorted(waiting, key=lambda r: (len(r.fill_ids), r.arrival))


class BrokenKey:
    name = "demo-broken-key"

    def key(self, node, now):
        raise RuntimeError("this eviction policy is broken on purpose")


class BrokenOrder:
    name = "demo-broken-order"
    cache_aware = False

    def order(self, waiting, cache, now):
        raise RuntimeError("this schedule policy is broken on purpose")
