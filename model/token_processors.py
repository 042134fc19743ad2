"""The built-in logit processors (radixserve/logit_processors.py has the contract): ban token ids, or allow only
some. Both take ``custom_params`` ``{"token_ids": [ids]}``; allow-tokens also takes SGLang's example's
``{"token_id": id}`` (its DeterministicLogitProcessor: one id, forced at every step). A whole batch of rows is
changed by one indexed write, whatever each row's ids."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MAX_IDS = 4096  # token ids one request may list


def token_ids(params: dict[str, Any]) -> list[int]:
    """The ids a request lists: ``token_ids`` (a list) or ``token_id`` (one)."""
    if "token_ids" in params:
        ids = params["token_ids"]
        return list(ids) if isinstance(ids, list) else ids
    return [params["token_id"]] if "token_id" in params else []


def check_ids(params: dict[str, Any], vocab_size: int, at_least_one: bool) -> None:
    unknown = set(params) - {"token_ids", "token_id"}
    if unknown:
        raise ValueError(f"unknown parameter {sorted(unknown)[0]!r}; give {{\"token_ids\": [ids]}}")
    if "token_ids" in params and "token_id" in params:
        raise ValueError("give token_ids or token_id, not both")
    ids = token_ids(params)
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ValueError("token_ids must be a list of token ids (integers)")
    if len(ids) > MAX_IDS:
        raise ValueError(f"{len(ids)} token ids; at most {MAX_IDS}")
    if at_least_one and not ids:
        raise ValueError("allow at least one token id ({\"token_ids\": [ids]})")
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def rows_and_ids(params: list[dict[str, Any]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) of every id every row lists, as two index tensors."""
    import torch

    pairs = [(j, t) for j, p in enumerate(params) for t in token_ids(p)]
    rows = torch.tensor([j for j, _ in pairs], dtype=torch.int64, device=device)
    ids = torch.tensor([t for _, t in pairs], dtype=torch.int64, device=device)
    return rows, ids


class BanTokens:
    """These token ids are never sampled."""

    name = "ban-tokens"

    def check(self, params: dict[str, Any], vocab_size: int) -> None:
        check_ids(params, vocab_size, at_least_one=False)

    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any]], output_index: list[int]) -> None:
        rows, ids = rows_and_ids(params, logits.device)
        logits[rows, ids] = float("-inf")


class AllowTokens:
    """Only these token ids may be sampled (one id: it is forced, as SGLang's DeterministicLogitProcessor does)."""

    name = "allow-tokens"

    def check(self, params: dict[str, Any], vocab_size: int) -> None:
        check_ids(params, vocab_size, at_least_one=True)

    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any]], output_index: list[int]) -> torch.Tensor:
        import torch

        rows, ids = rows_and_ids(params, logits.device)
        out = torch.full_like(logits, float("-inf"))
        out[rows, ids] = logits[rows, ids]
        return out
