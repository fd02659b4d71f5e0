"""Block-sparse PASA on a video transformer's self-attention: the processor of the sparse backends (issue 46).

``SparsePASAAttnProcessor`` is ``PASAAttnProcessor`` (its precision, shift and fallbacks) whose calls in a video
transformer's self-attention (module kind ``SELF_KIND``, which ``install.apply`` gives it as ``kind``) run
``pasa_attention(..., block_mask=)`` once it is bound to a generation's token sequence (:meth:`bind`;
``pipelines.sparse.sparse_bound`` binds every such processor of a pipeline, and ``pipelines.video.generate``
does that for each video).  A bound self-attention call of step ``s`` in layer ``l`` (the ``l``-th self-attention
module of the denoiser, from 0):

1. runs dense (the op without a mask) where the ``SparseSchedule`` says so: the first ``dense_steps`` denoising
   steps and the first ``dense_layers`` layers (Radial Attention keeps them dense: early steps lay out the
   scene, whose attention is not yet local);
2. else puts q, k, v in the mask's token order (``order="tile"``: compact 3D tiles of 128 tokens,
   ``video_masks.tile_order``, so that a block is a tile; ``"model"``: the model's own order), builds the call's
   mask (a static mask once per binding, the pooled mask from the call's own q and k), runs the op with it and
   puts the output back in the model's order.  The reorder costs three gathers of q, k, v and one of the output.

A key-padding mask that drops keys (a padded prompt in a joint attention) keeps the call sparse where each batch
element's kept keys are the first ones of the sequence in the mask's order (the text after the video, its padding
at the end: HunyuanVideo): each element attends its kept keys with the mask's blocks over them.  A model that
drops its padded text tokens from the sequence itself (Mochi, per batch element) calls with a prefix of the bound
sequence: it runs with the mask's blocks over that prefix.  Counted
(eager mode, as ``calls``): ``sparse_calls``, and ``dense_calls`` per reason: ``"schedule"``, and ``"key
padding"`` for a key-padding mask whose kept keys are not such a prefix (padding before the video tokens: the
call runs dense on its kept keys; logged once per process).  Cross-attention and
every other module run dense, as ``PASAAttnProcessor`` does.  A bound call whose sequence is not the bound
grid's, or a self-attention call before any binding, raises ``ValueError`` naming the module: a sparse backend
never runs dense without saying so.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .backends import SELF_KIND
from .block_sparse import DEFAULT_BLOCK
from .mask_coverage import head_density
from .masks import KeptKeys, kept_keys
from .ops import pasa_attention
from .processors import PASAAttnProcessor
from .variants import DEFAULT_PRECISION, DEFAULT_SHIFT
from .video_masks import TEXT_LAST, MaskBuilder, MaskChoice, SparseSchedule, TokenOrder, VideoTokens, tile_order

__all__ = ["ORDERS", "SparseBinding", "SparsePASAAttnProcessor"]

logger = logging.getLogger("pasa_diffusers")

ORDERS = ("tile", "model")
"""``tile``: the masks are built on the sequence reordered into compact 3D tiles (``video_masks.tile_order``);
``model``: on the model's own order (frame, row, column)."""

_WARNED: set[str] = set()
"""The dense-call reasons already logged (once per process)."""


@dataclass(frozen=True, eq=False)
class SparseBinding:
    """What a bound processor needs: the ``tokens`` of the self-attention sequence, the ``order`` the mask is
    built in (``None``: the model's), the mask ``build``er of a call (q, k in that order, (B, H, N, D)) and the
    processor's ``layer`` (its index among the denoiser's self-attention modules)."""

    tokens: VideoTokens
    order: TokenOrder | None
    build: MaskBuilder
    layer: int


def _prefix_lengths(kept: KeptKeys, order: TokenOrder | None) -> list[int] | None:
    """Per batch element how many keys a key-padding mask keeps, where they are the first ones of the sequence in
    the mask's ``order`` (text tokens after the video's, their padding at the end: HunyuanVideo's and Mochi's joint
    attention); ``None`` where any element keeps others."""
    lengths = []
    for positions in kept.positions:
        placed = positions if order is None else order.inverse.to(positions.device)[positions]
        if not bool((torch.sort(placed).values == torch.arange(len(placed), device=placed.device)).all()):
            return None
        lengths.append(len(placed))
    return lengths


class SparsePASAAttnProcessor(PASAAttnProcessor):
    r"""
    ``PASAAttnProcessor`` with a block-sparse mask on a video transformer's self-attention (module docstring).

    Args:
        precision, shift, beta, dtype: as ``PASAAttnProcessor``.
        mask: the mask's kind, one of ``video_masks.MASK_KINDS`` (``"radial"``, ``"tile-window"``, ``"pooled"``),
            with its parameters ``window``, ``spatial_window``, ``sink_frames``, ``keep`` (``video_masks.MaskChoice``).
        dense_steps, dense_layers: the schedule (``video_masks.SparseSchedule``): dense for the first steps and
            layers, sparse after.
        order: one of ``ORDERS``, the token order the mask is built in.

    Attributes:
        choice: the ``MaskChoice``; ``schedule``: the ``SparseSchedule``; ``binding``: the ``SparseBinding`` or
        ``None``; ``sparse_now``: whether the bound step and layer run sparse (:meth:`at_step`; a bool, so that
        a compiled model holds two graphs at most, not one per step); ``sparse_calls`` and ``dense_calls`` (per
        reason): the self-attention calls, in eager mode;
        ``density``: the share of (query, key) pairs a static mask keeps (``mask_coverage.head_density``), from
        the last binding (``None`` for the pooled mask, whose density is each call's).
    """

    def __init__(
        self,
        precision: str = DEFAULT_PRECISION,
        shift: bool | str = DEFAULT_SHIFT,
        beta: float | None = None,
        mask: str = "radial",
        window: tuple[int, int, int] = (1, 3, 3),
        spatial_window: int | None = None,
        sink_frames: int = 1,
        keep: float = 0.9,
        dense_steps: int = 12,
        dense_layers: int = 1,
        order: str = "tile",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(precision=precision, shift=shift, beta=beta, dtype=dtype)
        fn = type(self).__name__
        if order not in ORDERS:
            raise ValueError(f"{fn}: order must be one of {ORDERS}, got order={order!r}")
        try:
            self.choice = MaskChoice(mask, window=tuple(window), spatial_window=spatial_window,
                                     sink_frames=sink_frames, keep=keep)
            self.schedule = SparseSchedule(dense_steps, dense_layers)
        except ValueError as error:
            raise ValueError(f"{fn}: {error}") from error
        self.order = order
        self.binding: SparseBinding | None = None
        self.sparse_calls = 0
        self.dense_calls: dict[str, int] = {}
        self.density: float | None = None
        self.sparse_now = False

    def bind(self, tokens: VideoTokens, *, layer: int, device: torch.device | str) -> None:
        """Run sparse on the self-attention of ``tokens`` as layer ``layer``, from denoising step 0 (:meth:`at_step`
        moves it on); a static mask is built here, once, on ``device``."""
        choice = self.choice.resolved(tokens)
        order = tile_order(tokens) if self.order == "tile" else None
        static = choice.static_mask(tokens, order, DEFAULT_BLOCK, device)
        self.density = None if static is None else float(head_density(static, 1, 1).mean())
        build = choice.builder(tokens, order, DEFAULT_BLOCK, device) if static is None else lambda q, k: static
        if order is not None:  # on the device once, not copied there at every call
            order = TokenOrder(order.perm.to(device), order.inverse.to(device))
        self.binding = SparseBinding(tokens, order, build, layer)
        self.at_step(0)

    def at_step(self, step: int) -> None:
        """The generation is at denoising step ``step`` (from 0): ``sparse_now`` from the schedule."""
        self.sparse_now = self.schedule.sparse(step, self.binding.layer)

    def unbind(self) -> None:
        self.binding = None
        self.sparse_now = False

    def _count_dense(self, reason: str) -> None:
        if torch.compiler.is_compiling():
            return
        self.dense_calls[reason] = self.dense_calls.get(reason, 0) + 1
        if reason == "key padding" and reason not in _WARNED:
            _WARNED.add(reason)
            logger.warning("%s: a key-padding mask that drops keys in %s; that call runs dense on its kept keys "
                           "(counted in .dense_calls, logged once per process)", type(self).__name__, self.name)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        attention_mask: torch.Tensor | None = None,
        precision: str | None = None,
    ) -> torch.Tensor:
        """The sparse call of a bound self-attention module (module docstring); ``PASAAttnProcessor``'s dense call
        for any other module and for the one-key-block fallback (which passes ``precision``)."""
        if self.kind != SELF_KIND or precision is not None:
            return super().attention(query, key, value, scale, attention_mask, precision)
        where = f"{type(self).__name__} in {self.name or 'an attention module'}"
        bound = self.binding
        if bound is None:
            raise ValueError(f"{where}: not bound to a generation's token grid; generate through "
                             "pasa_diffusers.pipelines.video.generate, or call the pipeline inside "
                             "pipelines.sparse.sparse_bound(pipe, video.self_attention_tokens(pipe, num_frames=..., "
                             "height=..., width=...))")
        t, n = bound.tokens, query.shape[1]
        if key.shape[1] != n or not (n == t.n_tokens or (t.text_at == TEXT_LAST and t.n_video <= n < t.n_tokens)):
            raise ValueError(f"{where}: attends {query.shape[1]} queries to {key.shape[1]} keys, but it is bound to "
                             f"the {t.frames}x{t.height}x{t.width} video tokens + {t.text} text tokens "
                             f"({t.n_tokens}, or a prefix of them holding every video token where the text comes "
                             "last); bind it to this generation's size")
        if not self.sparse_now:
            self._count_dense("schedule")
            return super().attention(query, key, value, scale, attention_mask)
        lengths = None
        if attention_mask is not None:
            kept = kept_keys(attention_mask, key.shape[0], key.shape[1])
            lengths = None if kept.all_kept else _prefix_lengths(kept, bound.order)
            if not kept.all_kept and lengths is None:
                self._count_dense("key padding")
                return super().attention(query, key, value, scale, attention_mask)
        if not torch.compiler.is_compiling():
            self.sparse_calls += 1
        order = bound.order
        if order is not None and n < t.n_tokens:  # padded text dropped from the end: the order's first n places
            order = TokenOrder(order.perm[:n], order.inverse[:n])
        if order is not None:
            query, key, value = (order.apply(x, dim=1) for x in (query, key, value))
        try:
            if lengths is None:
                out = self._masked(query, key, value, scale)
            else:  # each batch element on its kept keys, a prefix of the sequence
                out = torch.cat([self._masked(query[b:b + 1], key[b:b + 1, :n], value[b:b + 1, :n], scale)
                                 for b, n in enumerate(lengths)])
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        return out if order is None else order.undo(out, dim=1)

    def _masked(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
        """The op with the call's mask on ``(B, N, H, D)`` tensors in the mask's order; queries and keys a prefix
        of the bound sequence (dropped padding, a key-padding mask's kept keys) take the mask's blocks over them."""
        block_mask = self.binding.build(query.transpose(1, 2), key.transpose(1, 2))
        if (block_mask.q_len, block_mask.kv_len) != (query.shape[1], key.shape[1]):
            block_mask = block_mask.prefix(query.shape[1], key.shape[1])
        return pasa_attention(query, key, value, scale=scale, precision=self.precision, shift=self.shift,
                              beta=self.beta, layout="bnhd", block_mask=block_mask)
