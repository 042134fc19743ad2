"""Demo logit processors: one that forces a counting sequence, one that fails (a broken plugin fails the requests
that use it, never the server)."""


class CountUp:
    """Forces token ``start + i`` as the i-th output token (custom_params: {"start": id}): the output is start,
    start + 1, start + 2, ... whatever the model prefers."""

    name = "demo-count-up"

    def check(self, params, vocab_size):
        start = params.get("start")
        if type(start) is not int or not 0 <= start < vocab_size:
            raise ValueError(f"start must be a token id in [0, {vocab_size})")

    def __call__(self, logits, params, output_index):
        import torch  # here, not at the top: the scheduler's process, which checks params, has no torch

        rows = torch.arange(len(params), device=logits.device)
        ids = torch.tensor([p["start"] + i for p, i in zip(params, output_index)], device=logits.device)
        forced = torch.full_like(logits, float("-inf"))
        forced[rows, ids.clamp(max=logits.shape[1] - 1)] = 0.0
        return forced


class Broken:
    name = "demo-broken"

    def __call__(self, logits, params, output_index):
        raise RuntimeError("this logit processor is broken on purpose")
