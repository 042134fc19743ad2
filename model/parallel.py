"""Tensor parallelism over torch.distributed: which part of every layer a rank holds, and the two collectives
the model needs (an all-reduce after each row-parallel projection, a gather of the vocabulary shards' logits).

The split, as Megatron and SGLang do it:
- Q/K/V and gate/up are column-parallel: a rank holds its heads' rows (its share of the intermediate rows), so
  attention and SiLU-mul run on local data with no communication.
- O and down are row-parallel: a rank holds the matching input columns; its product is a partial sum, and one
  all-reduce per projection makes the full hidden state on every rank.
- The embedding and the output projection are vocabulary-parallel: a rank holds ceil(vocab / tp) rows (the last
  shard padded with zeros); the embedding is an all-reduce of masked lookups, the logits are gathered on rank 0,
  the one rank that samples.
- KV heads: a rank holds num_kv_heads / tp of them, or, when tp > num_kv_heads, one KV head that tp /
  num_kv_heads ranks each hold a copy of (its query heads are the ones that read it).
"""
from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from radixserve.model.config import ModelConfig


def check_divisible(tp: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """ValueError, naming what does not divide, if ``tp`` ranks cannot split this model's layers evenly."""
    if tp == 1:
        return
    problems = []
    if num_heads % tp:
        problems.append(f"its {num_heads} attention heads")
    if (num_kv_heads % tp) if tp <= num_kv_heads else (tp % num_kv_heads):
        problems.append(f"its {num_kv_heads} KV heads (tp must divide them, or be a multiple of them so each "
                        "rank holds a copy of one)")
    if intermediate_size % tp:
        problems.append(f"its MLP width {intermediate_size}")
    if problems:
        fits = [n for n in range(1, num_heads + 1) if num_heads % n == 0 and intermediate_size % n == 0
                and ((num_kv_heads % n == 0) if n <= num_kv_heads else (n % num_kv_heads == 0))]
        raise ValueError(f"--tp {tp} cannot split this model evenly: {tp} does not divide {' or '.join(problems)}; "
                         f"tp values that fit: {', '.join(map(str, fits))}")


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the tensor-parallel ranks (``size`` 1: no parallelism, no torch.distributed)."""

    rank: int = 0
    size: int = 1
    device: str = "cpu"  # where this rank's tensors live (a collective's own tensors too: NCCL takes CUDA ones)

    @property
    def samples(self) -> bool:
        """Rank 0 samples (and alone answers the scheduler); the others only compute their share."""
        return self.rank == 0

    def part(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's share of ``n`` rows split evenly (``n`` divisible by size)."""
        share = n // self.size
        return self.rank * share, share

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds: its own share, or one head shared by several ranks."""
        if self.size <= num_kv_heads:
            return self.part(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, rows held, rows of them that are real) of this rank's vocabulary shard."""
        held = math.ceil(vocab_size / self.size)
        start = self.rank * held
        return start, held, max(0, min(held, vocab_size - start))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (``x`` itself on one rank). Half-precision partial sums are added in
        float32 and rounded once, as one rank's matmul would."""
        if self.size == 1:
            return x
        import torch
        import torch.distributed as dist

        wide = x if x.dtype == torch.float32 else x.float()
        dist.all_reduce(wide)
        return wide if wide is x else wide.to(x.dtype)

    def first_ranks(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (what node 0 decided, e.g. the KV pool's size from its memory)."""
        if self.size == 1:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0: the full ``[rows, vocab]`` logits from every rank's ``[rows, shard]``; other ranks: their own
        (which they do not use)."""
        if self.size == 1:
            return logits
        import torch
        import torch.distributed as dist

        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else logits


SINGLE = TPGroup()


def init_group(rank: int, size: int, backend: str, init_addr: str, timeout_s: float,
               device: str = "cpu") -> TPGroup:
    """Join the ``size`` ranks at ``init_addr`` (HOST:PORT, rank 0's TCP store). ``timeout_s`` bounds every
    collective, so a rank whose peer died fails instead of waiting forever. ``device``: this rank's (on CUDA,
    its own GPU)."""
    if size == 1:
        return SINGLE
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    host, _, port = init_addr.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal
    if rank == 0:  # the store listens on init_addr's address only (torch's own would listen on every interface)
        listener = _listen(host, int(port))
        store = dist.TCPStore(host, int(port), size, True, timeout, wait_for_workers=False,
                              master_listen_fd=listener.detach())  # the store owns the socket from here
    else:
        store = dist.TCPStore(host, int(port), size, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return TPGroup(rank, size, device)


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host`` (a name or an address) only."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise OSError(f"the tensor-parallel ranks' store cannot listen on {host}:{port}: {exc}") from None
    return sock


def kv_heads_per_rank(tp: int, num_kv_heads: int) -> int:
    return TPGroup(0, tp).kv_heads(num_kv_heads)[1]


def shard_of(cfg: ModelConfig, tp: TPGroup, name: str) -> tuple[int, int, int] | None:
    """The part of the checkpoint tensor ``name`` that this rank loads: (dim, start, length), or None for the
    whole tensor (norms, and everything on one rank)."""
    if tp.size == 1:
        return None
    module, _, param = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    d = cfg.head_dim
    if leaf == "q_proj":
        start, n = tp.part(cfg.num_heads)
        return 0, start * d, n * d
    if leaf in ("k_proj", "v_proj"):
        start, n = tp.kv_heads(cfg.num_kv_heads)
        return 0, start * d, n * d
    if leaf in ("gate_proj", "up_proj"):
        return (0, *tp.part(cfg.intermediate_size))
    if leaf in ("o_proj", "down_proj"):
        if param == "bias":
            return None  # added once: rank 0 keeps it, the others hold zeros (see row_parallel_bias)
        width = cfg.num_heads * d if leaf == "o_proj" else cfg.intermediate_size
        return (1, *tp.part(width))
    if leaf in ("embed_tokens", "lm_head"):
        start, _, real = tp.vocab(cfg.vocab_size)
        return 0, start, real
    return None


def row_parallel_bias(tp: TPGroup, name: str) -> bool:
    """Whether ``name`` is the bias of a row-parallel projection that this rank must hold as zeros (the sum of
    the ranks' partial products gets it once, from rank 0)."""
    module, _, param = name.rpartition(".")
    return tp.rank > 0 and param == "bias" and module.rpartition(".")[2] in ("o_proj", "down_proj")


def read_part(tensor_slice: Any, cut: tuple[int, int, int] | None):
    """``cut`` of a safetensors slice (only those bytes are read), or the whole tensor."""
    if cut is None:
        return tensor_slice[:]
    dim, start, length = cut
    return tensor_slice[start : start + length] if dim == 0 else tensor_slice[:, start : start + length]
