"""Block-sparse masks for video transformers, from the latent grid (issue 46).

A video DiT's self-attention sees ``frames x height x width`` video tokens (after patching), row-major
(frame, then row, then column), and in joint-attention models (HunyuanVideo, CogVideoX) the text tokens
before or after them.  :class:`VideoTokens` describes that sequence; the masks here return a
:class:`~pasa_diffusers.block_sparse.BlockSparseMask` over it:

- :func:`tile_order` permutes the video tokens so that each ``block`` (128) consecutive tokens form a compact
  3D tile (Sliding Tile Attention's layout); attention runs on the permuted sequence and
  :meth:`TokenOrder.undo` restores the model's order after it;
- :func:`tile_window_mask`: a spatio-temporal window, a key block kept when its tokens lie within ``window``
  (frames, rows, columns) of the query block's;
- :func:`radial_mask`: Radial Attention's energy decay, the spatial window halving each time the temporal
  distance doubles, plus the first frame(s) as an attention sink;
- :func:`pooled_mask`: dynamic, per query block the key blocks with the largest pooled scores up to a share of
  the estimated mass (SpargeAttn's and DraftAttention's idea; torch ops on the inputs' device);
- :class:`SparseSchedule`: dense for the first steps and layers, sparse after;
- :class:`MaskChoice`: one of these masks (``MASK_KINDS``) and its parameters, which builds the mask of a call.

Text tokens attend densely and are attended densely (every block holding one is kept in both directions).
The static masks are decided on each block's bounding box of (frame, row, column), so a block that straddles
tiles is kept when any of its tokens is within reach: a mask never drops a pair its window keeps.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from .block_sparse import DEFAULT_BLOCK, BlockSparseMask

__all__ = ["TEXT_FIRST", "TEXT_LAST", "MASK_KINDS", "VideoTokens", "TokenOrder", "tile_order", "tile_window_mask",
           "radial_mask", "pooled_mask", "SparseSchedule", "MaskBuilder", "MaskChoice"]

TEXT_FIRST = "first"
"""The text tokens come before the video tokens (HunyuanVideo's and CogVideoX's joint sequence)."""
TEXT_LAST = "last"
"""The text tokens come after the video tokens."""
MASK_KINDS = ("tile-window", "radial", "pooled")
"""The masks a :class:`MaskChoice` builds (``pipelines.names.COVERAGE_MASKS`` says, torch-free, what each keeps)."""


@dataclass(frozen=True)
class VideoTokens:
    """The token sequence of a video DiT's self-attention: ``frames x height x width`` video tokens (the
    latent grid after patching), row-major, and ``text`` text tokens at ``text_at`` (``TEXT_FIRST`` or
    ``TEXT_LAST``; ``text=0`` for cross-attention models such as Wan)."""

    frames: int
    height: int
    width: int
    text: int = 0
    text_at: str = TEXT_FIRST

    def __post_init__(self) -> None:
        for name in ("frames", "height", "width"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"VideoTokens: {name} must be a positive int, got {name}={value!r}")
        if not (isinstance(self.text, int) and self.text >= 0):
            raise ValueError(f"VideoTokens: text must be an int >= 0, got text={self.text!r}")
        if self.text_at not in (TEXT_FIRST, TEXT_LAST):
            raise ValueError(f"VideoTokens: text_at must be {TEXT_FIRST!r} or {TEXT_LAST!r}, got {self.text_at!r}")

    @property
    def n_video(self) -> int:
        return self.frames * self.height * self.width

    @property
    def n_tokens(self) -> int:
        return self.n_video + self.text

    @property
    def video_start(self) -> int:
        return self.text if self.text_at == TEXT_FIRST else 0

    def check_length(self, n: int, fn: str) -> None:
        """ValueError when a sequence of ``n`` tokens is not this grid's."""
        if n != self.n_tokens:
            raise ValueError(f"{fn}: {n} tokens do not match the grid {self.frames}x{self.height}x{self.width} "
                             f"+ {self.text} text = {self.n_tokens} tokens")

    def coords(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Per token of the sequence, (frame, row, column) int64 (n_tokens, 3) and ``is_text`` bool
        (n_tokens,) (text tokens' coordinates are 0)."""
        t, y, x = torch.meshgrid(torch.arange(self.frames, device=device), torch.arange(self.height, device=device),
                                 torch.arange(self.width, device=device), indexing="ij")
        video = torch.stack([t.flatten(), y.flatten(), x.flatten()], dim=-1)
        text = torch.zeros(self.text, 3, dtype=torch.int64, device=device)
        flags = torch.zeros(self.n_tokens, dtype=torch.bool, device=device)
        s = self.video_start
        if self.text_at == TEXT_FIRST:
            xyz = torch.cat([text, video])
            flags[:s] = True
        else:
            xyz = torch.cat([video, text])
            flags[self.n_video:] = True
        return xyz, flags


@dataclass(frozen=True, eq=False)
class TokenOrder:
    """A permutation of the sequence: ``perm`` (n,) int64, the model's token at each new position, and its
    ``inverse``; ``apply`` reorders q, k, v (along ``dim``, default the sequence dim of (B, H, N, D)) and
    ``undo`` restores the output."""

    perm: torch.Tensor
    inverse: torch.Tensor

    def apply(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        return x.index_select(dim, self.perm.to(x.device))

    def undo(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        return x.index_select(dim, self.inverse.to(x.device))


def _default_tile(tokens: VideoTokens, block: int) -> tuple[int, int, int]:
    """A compact tile of about ``block`` tokens: a square of side ``s`` (the largest power of two with ``s^2 <=
    block``, cut to the frame) deep enough in frames to fill the block; e.g. (2, 8, 8) for 128.  (A tile of whole
    rows would keep the model's own order: every real grid's rows are at least 128 tokens or tile whole frames.)"""
    side = 1
    while (2 * side) ** 2 <= block:
        side *= 2
    th, tw = min(tokens.height, side), min(tokens.width, side)
    tt = min(tokens.frames, max(1, block // (th * tw)))
    return tt, th, tw


def tile_order(tokens: VideoTokens, tile: tuple[int, int, int] | None = None, *,
               block: int = DEFAULT_BLOCK) -> TokenOrder:
    """The order that groups the video tokens by 3D tiles of ``tile`` (frames, rows, columns; default: about
    ``block`` tokens, e.g. (2, 8, 8) for 128), tiles row-major over the tile grid, tokens row-major inside a
    tile; text tokens stay where they are.  With ``tt * th * tw == block`` and a grid divisible by the tile,
    every block is one tile."""
    tile = _default_tile(tokens, block) if tile is None else tuple(tile)
    if len(tile) != 3 or not all(isinstance(n, int) and n >= 1 for n in tile):
        raise ValueError(f"tile_order: tile must be three positive ints (frames, rows, columns), got tile={tile!r}")
    xyz, is_text = tokens.coords()
    video = xyz[~is_text]
    tt, th, tw = tile
    grid = (math.ceil(tokens.frames / tt), math.ceil(tokens.height / th), math.ceil(tokens.width / tw))
    tile_id = ((video[:, 0] // tt) * grid[1] + video[:, 1] // th) * grid[2] + video[:, 2] // tw
    inner = ((video[:, 0] % tt) * th + video[:, 1] % th) * tw + video[:, 2] % tw
    order = torch.argsort(tile_id * (tt * th * tw) + inner) + tokens.video_start
    text = torch.arange(tokens.text) + (0 if tokens.text_at == TEXT_FIRST else tokens.n_video)
    perm = torch.cat([text, order]) if tokens.text_at == TEXT_FIRST else torch.cat([order, text])
    return TokenOrder(perm, torch.argsort(perm))


def _block_boxes(tokens: VideoTokens, order: TokenOrder | None, block: int, device) -> tuple:
    """Per block of the (reordered) sequence: min and max (frame, row, column) of its video tokens (n_blocks, 3)
    and whether it holds a text token, whether it holds a video token."""
    xyz, is_text = tokens.coords(device)
    if order is not None:
        xyz, is_text = xyz[order.perm.to(device)], is_text[order.perm.to(device)]
    n = tokens.n_tokens
    nb = math.ceil(n / block)
    pad = nb * block - n
    big = torch.iinfo(torch.int64).max // 4
    vid = (~is_text)[:, None]
    lo = torch.nn.functional.pad(torch.where(vid, xyz, big), (0, 0, 0, pad), value=big).view(nb, block, 3).amin(1)
    hi = torch.nn.functional.pad(torch.where(vid, xyz, -big), (0, 0, 0, pad), value=-big).view(nb, block, 3).amax(1)
    text = torch.nn.functional.pad(is_text, (0, pad)).view(nb, block).any(1)
    has_video = torch.nn.functional.pad(~is_text, (0, pad)).view(nb, block).any(1)
    return lo, hi, text, has_video


def _box_gap(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per pair of blocks (nq, nk, 3): the smallest distance along each axis between their boxes."""
    return torch.clamp(torch.maximum(lo[:, None] - hi[None], lo[None] - hi[:, None]), min=0)


def _with_text(video_keep: torch.Tensor, text: torch.Tensor, has_video: torch.Tensor) -> torch.Tensor:
    keep = video_keep & has_video[:, None] & has_video[None]
    return keep | text[:, None] | text[None]


def tile_window_mask(tokens: VideoTokens, window: tuple[int, int, int], *, order: TokenOrder | None = None,
                     block: int = DEFAULT_BLOCK, device: torch.device | str = "cpu") -> BlockSparseMask:
    """The spatio-temporal window: query block ``i`` keeps key block ``j`` when some of their video tokens lie
    within ``window`` = (frames, rows, columns) of each other along every axis; text blocks dense.  ``order``:
    the blocks of the reordered sequence (:func:`tile_order`: compact tiles, a sparser mask at the same
    window).  Shared by every batch and head: (1, 1, nq, nk)."""
    if len(window) != 3 or not all(isinstance(w, int) and w >= 0 for w in window):
        raise ValueError(f"tile_window_mask: window must be three ints >= 0 (frames, rows, columns), "
                         f"got window={window!r}")
    lo, hi, text, has_video = _block_boxes(tokens, order, block, device)
    reach = (_box_gap(lo, hi) <= torch.tensor(window, device=lo.device)).all(-1)
    n = tokens.n_tokens
    return BlockSparseMask.from_dense(_with_text(reach, text, has_video), n, n, block_q=block, block_k=block)


def radial_mask(tokens: VideoTokens, *, spatial_window: int | None = None, sink_frames: int = 1,
                order: TokenOrder | None = None, block: int = DEFAULT_BLOCK,
                device: torch.device | str = "cpu") -> BlockSparseMask:
    """Radial Attention's energy-decay mask: at temporal distance ``d`` frames the spatial window (rows and
    columns, Chebyshev) is ``spatial_window / 2^ceil(log2(d + 1))`` (the full window in the same frame,
    halved at distance 1, quartered at 2-3, ...); where it falls below one token the frame pair is dropped.
    The first ``sink_frames`` frames are kept for every query (the attention sink); text blocks dense.
    ``spatial_window`` defaults to the larger side of the frame."""
    if spatial_window is None:
        spatial_window = max(tokens.height, tokens.width)
    if not (isinstance(spatial_window, int) and spatial_window >= 1):
        raise ValueError(f"radial_mask: spatial_window must be a positive int, got spatial_window={spatial_window!r}")
    lo, hi, text, has_video = _block_boxes(tokens, order, block, device)
    gap = _box_gap(lo, hi)
    d = gap[..., 0].double()
    reach = torch.floor(spatial_window / torch.exp2(torch.ceil(torch.log2(d + 1.0))))
    keep = (reach >= 1) & (gap[..., 1:].double() <= reach[..., None]).all(-1)
    keep = keep | (lo[None, :, 0] < sink_frames)
    n = tokens.n_tokens
    return BlockSparseMask.from_dense(_with_text(keep, text, has_video), n, n, block_q=block, block_k=block)


def _pool(x: torch.Tensor, block: int) -> torch.Tensor:
    """Means of ``x`` (B, H, N, D) over each ``block`` tokens (the ragged last block over its own): (B, H, nb, D)."""
    n = x.shape[-2]
    nb = math.ceil(n / block)
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, nb * block - n))
    sizes = torch.clamp(n - torch.arange(nb, device=x.device) * block, max=block).to(torch.float32)
    return padded.unflatten(-2, (nb, block)).sum(-2) / sizes[:, None], sizes


def pooled_mask(q: torch.Tensor, k: torch.Tensor, *, mass: float = 0.9, min_blocks: int = 1,
                block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK,
                scale: float | None = None) -> BlockSparseMask:
    """Dynamic mask from pooled scores: per (batch, query head, query block) the key blocks in decreasing
    estimated mass ``softmax_j(scale qbar_i . kbar_j + log n_j)`` (``qbar``/``kbar`` the block means, ``n_j``
    the block's keys) until their share reaches ``mass`` (the block that crosses it included), at least
    ``min_blocks``.  Torch ops on ``q``'s device, fp32, nothing read back (``from_dense(validate=False)``: a
    compiled or captured call stays whole); q (B, Hq, Nq, D), k (B, Hk, Nk, D) with GQA.  The estimate is only as
    good as the blocks are uniform: check it with ``mask_coverage.coverage``."""
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"pooled_mask: mass must be in (0, 1], got mass={mass!r}")
    if q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"pooled_mask: q (B, Hq, Nq, D) and k (B, Hk, Nk, D) with Hq a multiple of Hk, got "
                         f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q_bar, _ = _pool(q, block_q)
    k_bar, sizes = _pool(k, block_k)
    k_bar = k_bar.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    est = torch.softmax(scale * (q_bar @ k_bar.transpose(-1, -2)) + torch.log(sizes), dim=-1)
    share, idx = torch.sort(est, dim=-1, descending=True)
    before = torch.cumsum(share, dim=-1) - share  # the mass of the blocks ranked above
    rank = torch.arange(share.shape[-1], device=q.device)
    take = (before < mass) | (rank < min_blocks)
    dense = torch.zeros_like(take).scatter_(-1, idx, take)
    return BlockSparseMask.from_dense(dense, q.shape[-2], k.shape[-2], block_q=block_q, block_k=block_k,
                                      validate=False)  # built on the device in the call: nothing read back


@dataclass(frozen=True)
class SparseSchedule:
    """When to use the mask: dense for the first ``dense_steps`` denoising steps and the first ``dense_layers``
    transformer blocks (Radial Attention's defaults for Wan: 12 of 50 steps, 1 layer), sparse after."""

    dense_steps: int = 12
    dense_layers: int = 1

    def __post_init__(self) -> None:
        for name in ("dense_steps", "dense_layers"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 0):
                raise ValueError(f"SparseSchedule: {name} must be an int >= 0, got {name}={value!r}")

    def sparse(self, step: int, layer: int) -> bool:
        """Whether ``step`` (0-based denoising step) and ``layer`` (0-based block index) run sparse."""
        return step >= self.dense_steps and layer >= self.dense_layers

    def mask_for(self, step: int, layer: int, mask: BlockSparseMask) -> BlockSparseMask | None:
        """``mask`` where the schedule is sparse, None (dense) elsewhere."""
        return mask if self.sparse(step, layer) else None


MaskBuilder = Callable[[torch.Tensor, torch.Tensor], BlockSparseMask]
"""Builds the mask of one call from its q and k, (B, H, N, D) in the masks' order."""


@dataclass(frozen=True)
class MaskChoice:
    """One mask: ``kind`` (one of ``MASK_KINDS``) and its parameters: ``window`` (frames, rows, columns;
    ``tile-window``), ``spatial_window`` (``None``: the larger side of the frame) and ``sink_frames``
    (``radial``), ``keep`` (the share of the estimated mass kept; ``pooled``)."""

    kind: str
    window: tuple[int, int, int] = (1, 3, 3)
    spatial_window: int | None = None
    sink_frames: int = 1
    keep: float = 0.9

    def __post_init__(self) -> None:
        if self.kind not in MASK_KINDS:
            raise ValueError(f"MaskChoice: unknown kind={self.kind!r}; expected one of {', '.join(MASK_KINDS)}")

    @property
    def label(self) -> str:
        """The mask and its parameters, as the reports name it."""
        if self.kind == "tile-window":
            return f"tile-window (window {','.join(map(str, self.window))})"
        if self.kind == "radial":
            side = "the frame's larger side" if self.spatial_window is None else self.spatial_window
            return f"radial (spatial window {side}, {self.sink_frames} sink frame(s))"
        return f"pooled (keep {self.keep:g} of the estimated mass)"

    def parameters(self) -> dict[str, Any]:
        """The parameters that apply to this kind."""
        names = {"tile-window": ("window",), "radial": ("spatial_window", "sink_frames"), "pooled": ("keep",)}
        return {name: value for name, value in asdict(self).items() if name in names[self.kind]}

    def resolved(self, tokens: VideoTokens) -> MaskChoice:
        """This choice with the defaults that depend on the grid made explicit (``radial``'s ``spatial_window``:
        the larger side of the frame), as a report names it."""
        if self.kind == "radial" and self.spatial_window is None:
            return replace(self, spatial_window=max(tokens.height, tokens.width))
        return self

    def static_mask(self, tokens: VideoTokens, order: TokenOrder | None, block: int,
                    device: torch.device | str) -> BlockSparseMask | None:
        """The static mask of ``tokens`` (in ``order``) on ``device``; ``None`` for the pooled mask (each call's)."""
        if self.kind == "tile-window":
            return tile_window_mask(tokens, self.window, order=order, block=block, device=device)
        if self.kind == "radial":
            return radial_mask(tokens, spatial_window=self.spatial_window, sink_frames=self.sink_frames, order=order,
                               block=block, device=device)
        return None

    def builder(self, tokens: VideoTokens, order: TokenOrder | None, block: int,
                device: torch.device | str) -> MaskBuilder:
        """The mask of a call: the static mask built once (:meth:`static_mask`), or the pooled mask of the call's
        own q and k."""
        mask = self.static_mask(tokens, order, block, device)
        if mask is None:
            return lambda q, k: pooled_mask(q, k, mass=self.keep, block_q=block, block_k=block)
        return lambda q, k: mask
