"""Block-sparse masks: which key blocks each query block attends to (issue 46).

A :class:`BlockSparseMask` cuts the queries into blocks of ``block_q`` rows and the keys into blocks of
``block_k`` keys (the last of each ragged: ``q_len``/``kv_len`` need not be multiples) and lists, per
(batch, head, query block), the kept key blocks in the compact form FlashAttention-3, FlexAttention and
SpargeAttn kernels read:

- ``kv_counts`` int32 (B or 1, H or 1, n_q_blocks): how many key blocks the query block visits;
- ``kv_indices`` int32 (B or 1, H or 1, n_q_blocks, n_k_blocks): their indices, ascending in the first
  ``kv_counts`` entries, the rest padding (``n_k_blocks``, never read).

A size 1 in the batch or head dimension is shared by every batch or head; ``H`` may also be the number of key
heads under grouped-query attention (query head ``h`` reads mask head ``h // (Hq / H)``).  A skipped key block
contributes nothing; a query block that visits no key block (``kv_counts == 0``) is a defined result: zeros, and
log-sum-exp ``-inf``.  Every exact reference (``reference``, ``reference_int8``) takes ``block_mask=``, and so
does the op (``pasa_attention``): its portable kernels skip the missing key blocks (docs/SPARSE.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["BlockSparseMask", "DEFAULT_BLOCK"]

DEFAULT_BLOCK = 128
"""The default query and key block: PASA's shift block, the kernels' key tile."""


def _blocks(length: int, block: int) -> int:
    return max(1, math.ceil(length / block))


@dataclass(frozen=True, eq=False)
class BlockSparseMask:
    """The kept key blocks per (batch, head, query block), compact (the module docstring)."""

    kv_counts: torch.Tensor
    kv_indices: torch.Tensor
    q_len: int
    kv_len: int
    block_q: int = DEFAULT_BLOCK
    block_k: int = DEFAULT_BLOCK
    keeps_all: bool = field(init=False, default=False)
    """Every query block keeps every key block (found by :meth:`validate`'s reading of the counts; ``False`` for
    a mask made by :meth:`from_checked`, which reads nothing): the op then runs without the mask."""
    kept_share: float | None = field(init=False, default=None)
    """The share of the (query block, key block) pairs kept, read with ``keeps_all`` (``None`` for a mask made by
    :meth:`from_checked`: not known): what the router scales a call's work by when it cuts it into ranges."""

    def __post_init__(self) -> None:
        self.validate()
        kept_share = float(self.kv_counts.double().mean()) / self.n_k_blocks  # 1.0 exactly when every count is full
        object.__setattr__(self, "kept_share", kept_share)
        object.__setattr__(self, "keeps_all", kept_share == 1.0)

    # --- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, blocks: torch.Tensor, q_len: int, kv_len: int, *, block_q: int = DEFAULT_BLOCK,
                   block_k: int = DEFAULT_BLOCK, validate: bool = True) -> BlockSparseMask:
        """From a bool block tensor (n_q_blocks, n_k_blocks), (H, nq, nk) or (B, H, nq, nk): True = kept.
        ``validate=False`` reads nothing back from the device (:meth:`from_checked`: no sync, so a mask computed
        inside an attention call keeps the GPU's queue full, a CUDA graph capture and ``torch.compile``'s graph
        whole); the compact form made here is valid by construction, and ``keeps_all`` is then ``False``."""
        fn = "BlockSparseMask.from_dense"
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.bool:
            raise ValueError(f"{fn}: blocks must be a bool tensor, got "
                             f"{getattr(blocks, 'dtype', type(blocks).__name__)}")
        if not 2 <= blocks.dim() <= 4:
            raise ValueError(f"{fn}: blocks must be (nq, nk), (H, nq, nk) or (B, H, nq, nk), "
                             f"got blocks.shape={tuple(blocks.shape)}")
        while blocks.dim() < 4:
            blocks = blocks.unsqueeze(0)
        expect = (_blocks(q_len, block_q), _blocks(kv_len, block_k))
        if tuple(blocks.shape[-2:]) != expect:
            raise ValueError(f"{fn}: blocks.shape={tuple(blocks.shape)} does not end in the block grid {expect} of "
                             f"q_len={q_len}, kv_len={kv_len}, block_q={block_q}, block_k={block_k}")
        n_k = blocks.shape[-1]
        counts = blocks.sum(-1, dtype=torch.int32)
        # kept blocks first (ascending), then padding: sort keys (not kept, index)
        key = (~blocks).to(torch.int64) * n_k + torch.arange(n_k, device=blocks.device)
        order = torch.sort(key, dim=-1).values % n_k
        idx = torch.arange(n_k, device=blocks.device)
        indices = torch.where(idx < counts[..., None], order, torch.full_like(order, n_k)).to(torch.int32)
        if not validate:
            return cls.from_checked(counts, indices, q_len, kv_len, block_q, block_k)
        return cls(counts, indices, q_len, kv_len, block_q, block_k)

    @classmethod
    def full(cls, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1, block_q: int = DEFAULT_BLOCK,
             block_k: int = DEFAULT_BLOCK, device: torch.device | str = "cpu") -> BlockSparseMask:
        """Every key block kept (dense attention in the sparse form)."""
        shape = (batch, heads, _blocks(q_len, block_q), _blocks(kv_len, block_k))
        return cls.from_dense(torch.ones(shape, dtype=torch.bool, device=device), q_len, kv_len,
                              block_q=block_q, block_k=block_k)

    @classmethod
    def from_flex(cls, block_mask) -> BlockSparseMask:
        """From a FlexAttention ``BlockMask``: its partial and full blocks are both kept (the elementwise
        ``mask_mod`` inside partial blocks is not carried: a block is kept or not)."""
        q_len, kv_len = block_mask.seq_lengths
        block_q, block_k = block_mask.BLOCK_SIZE
        dense = _flex_dense(block_mask.kv_num_blocks, block_mask.kv_indices)
        if block_mask.full_kv_num_blocks is not None:
            dense = dense | _flex_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        nq, nk = _blocks(q_len, block_q), _blocks(kv_len, block_k)
        return cls.from_dense(dense[..., :nq, :nk], q_len, kv_len, block_q=block_q, block_k=block_k)

    @classmethod
    def from_checked(cls, kv_counts: torch.Tensor, kv_indices: torch.Tensor, q_len: int, kv_len: int,
                     block_q: int, block_k: int) -> BlockSparseMask:
        """The fields of a mask already validated, taken as they are: :meth:`validate` reads the tensors on the
        host (a device sync), which a CUDA graph capture forbids; the op's registered form rebuilds its mask
        from the fields this way (``keeps_all`` is then ``False``: not known)."""
        mask = object.__new__(cls)
        for name, value in (("kv_counts", kv_counts), ("kv_indices", kv_indices), ("q_len", q_len),
                            ("kv_len", kv_len), ("block_q", block_q), ("block_k", block_k)):
            object.__setattr__(mask, name, value)
        return mask

    def to(self, device: torch.device | str) -> BlockSparseMask:
        """This mask with its tensors on ``device`` (not validated again; ``keeps_all`` kept)."""
        mask = self.from_checked(self.kv_counts.to(device), self.kv_indices.to(device), self.q_len, self.kv_len,
                                 self.block_q, self.block_k)
        object.__setattr__(mask, "keeps_all", self.keeps_all)
        object.__setattr__(mask, "kept_share", self.kept_share)
        return mask

    def prefix(self, q_len: int, kv_len: int) -> BlockSparseMask:
        """This mask over the first ``q_len`` queries and ``kv_len`` keys only (a key-padding mask that drops a
        suffix of the keys; a model that drops its padded tokens from the end of the sequence): the blocks past
        them dropped, the last ones left ragged."""
        for name, value, whole in (("q_len", q_len, self.q_len), ("kv_len", kv_len, self.kv_len)):
            if not (isinstance(value, int) and 0 < value <= whole):
                raise ValueError(f"BlockSparseMask.prefix: {name} must be an int in [1, {whole}], got "
                                 f"{name}={value!r}")
        blocks = self.dense_blocks()[..., :_blocks(q_len, self.block_q), :_blocks(kv_len, self.block_k)]
        return BlockSparseMask.from_dense(blocks, q_len, kv_len, block_q=self.block_q, block_k=self.block_k)

    def select(self, batches: tuple[int, int], heads: tuple[int, int]) -> BlockSparseMask:
        """This mask on batch elements ``[b0, b1)`` and mask heads ``[h0, h1)``: views, not validated again
        (:meth:`from_checked`); a shared (size 1) batch or head dimension stays whole."""
        (b0, b1), (h0, h1) = batches, heads
        rows = slice(None) if self.kv_counts.shape[0] == 1 else slice(b0, b1)
        cols = slice(None) if self.kv_counts.shape[1] == 1 else slice(h0, h1)
        return self.from_checked(self.kv_counts[rows, cols], self.kv_indices[rows, cols], self.q_len, self.kv_len,
                                 self.block_q, self.block_k)

    def to_flex(self):
        """This mask as a FlexAttention ``BlockMask`` (every kept block a partial block with the default
        ``mask_mod``; flex masks the ragged tails by ``seq_lengths``).  ImportError names what is missing."""
        try:
            from torch.nn.attention.flex_attention import BlockMask
        except ImportError as exc:  # pragma: no cover - torch >= 2.11 has it
            raise ImportError(f"BlockSparseMask.to_flex: torch {torch.__version__} has no FlexAttention "
                              f"({exc})") from exc
        indices = torch.where(self.kv_indices >= self.n_k_blocks, 0, self.kv_indices)
        return BlockMask.from_kv_blocks(self.kv_counts, indices, BLOCK_SIZE=(self.block_q, self.block_k),
                                        seq_lengths=(self.q_len, self.kv_len))

    # --- reading ------------------------------------------------------------------------------------------
    @property
    def n_q_blocks(self) -> int:
        return self.kv_counts.shape[-1]

    @property
    def n_k_blocks(self) -> int:
        return self.kv_indices.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.kv_counts.device

    def dense_blocks(self) -> torch.Tensor:
        """The kept blocks as a bool tensor (B or 1, H or 1, n_q_blocks, n_k_blocks)."""
        idx = torch.arange(self.n_k_blocks, device=self.device)
        valid = idx < self.kv_counts[..., None]
        target = torch.where(valid, self.kv_indices.long(), torch.full_like(self.kv_indices.long(), self.n_k_blocks))
        out = torch.zeros(self.kv_indices.shape[:-1] + (self.n_k_blocks + 1,), dtype=torch.bool, device=self.device)
        out.scatter_(-1, target, True)
        return out[..., :-1]

    def kept_blocks(self, batch: int, heads: int) -> torch.Tensor:
        """:meth:`dense_blocks` broadcast to (batch, heads, nq, nk) query heads (GQA: a key-head mask repeated
        over its group)."""
        dense = self.dense_blocks()
        if dense.shape[1] not in (1, heads):
            dense = dense.repeat_interleave(heads // dense.shape[1], dim=1)
        return dense.expand(batch, heads, -1, -1)

    def element_mask(self) -> torch.Tensor:
        """The dense bool mask (B or 1, H or 1, q_len, kv_len) of the kept (query, key) pairs: a reference's
        input for SDPA or a masked golden attention (ragged tails cut to ``q_len`` and ``kv_len``)."""
        dense = self.dense_blocks()
        rows = dense.repeat_interleave(self.block_q, dim=-2)[..., :self.q_len, :]
        return rows.repeat_interleave(self.block_k, dim=-1)[..., :self.kv_len]

    @property
    def density(self) -> float:
        """The share of kept (query, key) pairs, ragged tails weighted by their size."""
        elems = self.element_mask()
        return float(elems.float().mean())

    # --- checks -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """ValueError naming the field when the compact form is inconsistent (dtypes, shapes, counts, indices
        out of range, indices not ascending)."""
        fn = "BlockSparseMask"
        for name, value in (("block_q", self.block_q), ("block_k", self.block_k), ("q_len", self.q_len),
                            ("kv_len", self.kv_len)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{fn}: {name} must be a positive int, got {name}={value!r}")
        c, i = self.kv_counts, self.kv_indices
        for name, t in (("kv_counts", c), ("kv_indices", i)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
                raise ValueError(f"{fn}: {name} must be an int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if c.dim() != 3 or i.dim() != 4 or tuple(i.shape[:3]) != tuple(c.shape):
            raise ValueError(f"{fn}: kv_counts (B, H, nq) and kv_indices (B, H, nq, nk) disagree: "
                             f"kv_counts.shape={tuple(c.shape)}, kv_indices.shape={tuple(i.shape)}")
        if c.device != i.device:
            raise ValueError(f"{fn}: kv_counts on {c.device} but kv_indices on {i.device}")
        grid = (_blocks(self.q_len, self.block_q), _blocks(self.kv_len, self.block_k))
        if (c.shape[-1], i.shape[-1]) != grid:
            raise ValueError(f"{fn}: kv_indices.shape={tuple(i.shape)} does not end in the block grid {grid} of "
                             f"q_len={self.q_len}, kv_len={self.kv_len}, block_q={self.block_q}, "
                             f"block_k={self.block_k}")
        n_k = grid[1]
        if bool(((c < 0) | (c > n_k)).any()):
            raise ValueError(f"{fn}: kv_counts must lie in [0, {n_k}], got min {int(c.min())}, max {int(c.max())}")
        valid = torch.arange(n_k, device=i.device) < c[..., None]
        if bool((valid & ((i < 0) | (i >= n_k))).any()):
            raise ValueError(f"{fn}: kv_indices out of range [0, {n_k}) among the first kv_counts entries")
        if n_k > 1 and bool((valid[..., 1:] & (i[..., 1:] <= i[..., :-1])).any()):
            raise ValueError(f"{fn}: kv_indices must be strictly ascending within kv_counts")

    def check_call(self, q: torch.Tensor, k: torch.Tensor, fn: str = "block_mask", *,
                   block_n: int | None = None) -> None:
        """ValueError naming the argument when this mask does not fit ``q`` (B, Hq, Nq, D) and ``k``
        (B, Hk, Nk, D): lengths, device, batch and head broadcast (1, Hk or Hq heads), and, given the
        caller's key tile ``block_n``, the key block."""
        b, hq, nq = q.shape[0], q.shape[1], q.shape[2]
        hk, nk = k.shape[1], k.shape[2]
        if (self.q_len, self.kv_len) != (nq, nk):
            raise ValueError(f"{fn}: block_mask is for q_len={self.q_len}, kv_len={self.kv_len}, got "
                             f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}")
        if self.device != q.device:
            raise ValueError(f"{fn}: block_mask is on {self.device} but q is on {q.device}")
        mb, mh = self.kv_counts.shape[:2]
        if mb not in (1, b):
            raise ValueError(f"{fn}: block_mask batch {mb} is neither 1 nor q's batch {b} (q.shape={tuple(q.shape)})")
        if mh not in (1, hk, hq):
            raise ValueError(f"{fn}: block_mask heads {mh} is none of 1, the key heads {hk} or the query heads {hq} "
                             f"(q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)})")
        if block_n is not None and block_n != self.block_k:
            raise ValueError(f"{fn}: block_mask.block_k={self.block_k} differs from the key block block_n={block_n}")


def _flex_dense(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    n_k = indices.shape[-1]
    valid = torch.arange(n_k, device=indices.device) < counts[..., None]
    target = torch.where(valid, indices.long(), torch.full_like(indices.long(), n_k))
    out = torch.zeros(indices.shape[:-1] + (n_k + 1,), dtype=torch.bool, device=indices.device)
    return out.scatter_(-1, target, True)[..., :-1]
