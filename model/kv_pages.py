"""Pages of KV below the pool, in the runner: their format (``PageCodec``: exact, or int8 / fp8 with scales) and
host memory, L2 (``HostTier``: least recently used pages out beyond a byte budget, never a page a read-back holds).
model/kv_tiers.py moves them."""
from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict, deque

import numpy as np
import torch

from radixserve.model.forward_batch import KVPool

FORMATS = ("auto", "int8", "fp8_e4m3")


class PageCodec:
    """A page's KV as it is kept below the pool: page-first ``[2 (K, V), layers, page, kv_heads, head_dim]`` (one
    page is one contiguous read), in the pool's dtype ("auto": exact) or int8 / fp8 (e4m3) with float32 scales:
    K's per channel over the page's tokens (``[layers, kv_heads, head_dim]``: keys carry outlier channels, which a
    scale per token would let swamp the rest), V's per token (``[layers, page, kv_heads]``).

    A pool of 8-bit codes (``codes``: --kv-cache-dtype int8/fp8) moves exactly: its codes, then its scales
    (``[2, layers, page, kv_heads]`` float32), as the pool holds them."""

    def __init__(self, fmt: str, dtype: torch.dtype, layers: int, kv_heads: int, head_dim: int, page: int,
                 codes: str | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown KV page format {fmt!r}; choose one of {', '.join(FORMATS)}")
        if codes is not None and fmt != "auto":
            raise ValueError(f"a pool of {codes} codes moves its pages as they are; page format {fmt} re-encodes "
                             "pages of a pool in the model's dtype")
        self.fmt, self.dtype, self.page = fmt, dtype, page
        self.shape = (2, layers, page, kv_heads, head_dim)
        # exact pages: each pool tensor's rows in turn, as (dtype, one page's shape of it): K, V (and their scales)
        one = (layers, page, kv_heads, head_dim)
        self.parts = [(dtype if codes is None else torch.uint8, one)] * 2
        if codes is not None:
            self.parts += [(torch.float32, one[:3])] * 2
        self.stored = {"auto": dtype, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[fmt]
        self.value_bytes = 2 * layers * page * kv_heads * head_dim * self.stored.itemsize
        self.k_scales = (layers, 1, kv_heads, head_dim)
        self.v_scales = (layers, page, kv_heads, 1)
        self.k_scale_bytes = 0 if fmt == "auto" else layers * kv_heads * head_dim * 4
        self.nbytes = (sum(math.prod(shape) * dt.itemsize for dt, shape in self.parts) if fmt == "auto" else
                       self.value_bytes + self.k_scale_bytes + layers * page * kv_heads * 4)
        self.limit = {"int8": 127.0, "fp8_e4m3": 448.0}.get(fmt)

    def encode(self, kv: KVPool, slots: np.ndarray) -> list[torch.Tensor]:
        """The pages of ``slots`` (page after page, ``page`` slots each), each a tensor of its own (``nbytes``
        uint8). Exact pages are gathered straight into their own memory: one copy, on the step's critical path."""
        idx = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        n = len(slots) // self.page
        if self.fmt == "auto":
            pages = []
            for i in range(n):
                page, at = torch.empty(self.nbytes, dtype=torch.uint8), 0
                part = idx[i * self.page : (i + 1) * self.page]
                for t, (dt, shape) in zip(kv.tensors, self.parts):
                    size = math.prod(shape) * dt.itemsize
                    torch.index_select(t, 1, part, out=page[at : at + size].view(dt).view(shape))
                    at += size
                pages.append(page)
            return pages
        x = torch.stack((kv.k[:, idx], kv.v[:, idx]))  # [2, L, n * page, H, D]
        x = x.view(2, x.shape[1], n, self.page, *x.shape[3:]).permute(2, 0, 1, 3, 4, 5)
        k, v = x[:, 0].float(), x[:, 1].float()  # [n, L, page, H, D]
        ks = k.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / self.limit
        vs = v.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / self.limit
        q = torch.stack((k / ks, v / vs), dim=1)
        q = q.round().clamp(-127, 127).to(torch.int8) if self.fmt == "int8" else q.to(self.stored)
        flat = torch.cat((q.reshape(n, -1).view(torch.uint8), ks.reshape(n, -1).view(torch.uint8),
                          vs.reshape(n, -1).view(torch.uint8)), dim=1)
        return [row.clone() for row in flat]  # owned: one page never keeps the batch alive

    def decode_into(self, kv: KVPool, pages: list[torch.Tensor], skip: int, slots: np.ndarray) -> None:
        """Tokens ``skip`` .. ``skip + len(slots)`` of ``pages`` (in order) into the pool's ``slots``."""
        n = len(pages)
        buf = torch.stack(pages)
        idx = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        if self.fmt == "auto":
            at = 0
            for t, (dt, shape) in zip(kv.tensors, self.parts):
                size = math.prod(shape) * dt.itemsize
                x = buf[:, at : at + size].contiguous().view(dt).view(n, *shape)  # [n, L, page, ...]
                x = x.transpose(0, 1).reshape(shape[0], n * self.page, *shape[2:])
                t[:, idx] = x[:, skip : skip + len(slots)]
                at += size
            return
        a, b = self.value_bytes, self.value_bytes + self.k_scale_bytes
        q = buf[:, :a].contiguous().view(self.stored).view(n, *self.shape).float()
        ks = buf[:, a:b].contiguous().view(torch.float32).view(n, *self.k_scales)
        vs = buf[:, b:].contiguous().view(torch.float32).view(n, *self.v_scales)
        x = torch.stack((q[:, 0] * ks, q[:, 1] * vs), dim=1).to(self.dtype)
        x = x.permute(1, 2, 0, 3, 4, 5).reshape(2, self.shape[1], n * self.page, *self.shape[3:])
        x = x[:, :, skip : skip + len(slots)]
        kv.k[:, idx] = x[0]
        kv.v[:, idx] = x[1]


class HostTier:
    """L2: encoded pages in this process's memory, least recently used first out beyond ``budget`` bytes. A page
    a read-back found is held for it (``fetch`` id) until loaded or let go; held pages are never dropped (with a
    budget of 0, L2 only holds what read-backs bring from storage, until they are loaded)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.lock = threading.Lock()
        self.pages: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self.held: dict[int, list[bytes]] = {}  # fetch id -> keys held for it
        self.holds: Counter[bytes] = Counter()
        self.live: set[int] = set()  # read-backs under way (a page is held only for one of these)
        self.gone: set[int] = set()  # read-backs let go lately (one asked for after its drop is not started)
        self._gone_order: deque[int] = deque()

    def __contains__(self, key: bytes) -> bool:
        return key in self.pages

    def hold(self, key: bytes, fid: int) -> bool:
        """Hold ``key`` for read-back ``fid`` if L2 has it (and ``fid`` is still wanted)."""
        with self.lock:
            if key not in self.pages or fid not in self.live:
                return False
            self.pages.move_to_end(key)
            self._hold(key, fid)
            return True

    def put(self, key: bytes, page: torch.Tensor, fid: int | None = None) -> bool:
        """Keep ``page`` (held for ``fid`` if given); False if ``fid`` is no longer wanted."""
        with self.lock:
            if fid is not None and fid not in self.live:
                return False
            if key not in self.pages:
                self.pages[key] = page
                self.nbytes += page.numel()
            self.pages.move_to_end(key)
            if fid is not None:
                self._hold(key, fid)
            self._trim()
            return True

    def take(self, key: bytes) -> torch.Tensor:
        with self.lock:
            return self.pages[key]

    def release(self, fid: int) -> None:
        with self.lock:
            self.live.discard(fid)
            if fid not in self.gone:
                self.gone.add(fid)
                self._gone_order.append(fid)
                if len(self._gone_order) > 1 << 16:
                    self.gone.discard(self._gone_order.popleft())
            for key in self.held.pop(fid, ()):
                self.holds[key] -= 1
                if self.holds[key] <= 0:
                    del self.holds[key]
            self._trim()

    def clear(self) -> None:
        with self.lock:
            for key in [k for k in self.pages if k not in self.holds]:
                self.nbytes -= self.pages.pop(key).numel()

    def _hold(self, key: bytes, fid: int) -> None:
        self.held.setdefault(fid, []).append(key)
        self.holds[key] += 1

    def _trim(self) -> None:
        excess = self.nbytes - self.budget
        if excess <= 0:
            return
        victims = []
        for key, page in self.pages.items():  # least recent first; held pages stay
            if excess <= 0:
                break
            if key not in self.holds:
                victims.append(key)
                excess -= page.numel()
        for key in victims:
            self.nbytes -= self.pages.pop(key).numel()
