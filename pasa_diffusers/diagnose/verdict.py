"""The verdict on one aggregated layer: its risk and cause rules (``aggregate.aggregate_layer``).

- risk = max |q . k| / 65504, the raw product over all calls: a kernel that rounds ``q k^T`` to FP16
  before scaling (naive FP16 attention) overflows where risk > 1; ``overflows`` = any raw score above
  65504 (``overflow_count > 0``).
- cause: per head, with token means ``m_q``, ``m_k`` (norms ``M_q``, ``M_k``), RMS norms of the centred
  tokens ``A_q = amplitude_q sqrt(D)``, ``A_k`` and ``cos = resonance_cos``, a score splits as
  ``q . k = m_q . m_k + m_q . x_k + x_q . m_k + x_q . x_k``, whose terms have the scales

      resonance  R = M_q M_k |cos|,     bias x amplitude  X = M_q A_k + A_q M_k,     amplitude  C = A_q A_k.

  On the dominant head (largest ``(M_q + A_q)(M_k + A_k)``, the scale of ``|q| |k|``) the largest of the
  three names the cause: R -> "bias (q .., k ..) + in-phase|anti-phase resonance (cos ..)",
  X -> "bias without resonance (q .., k .., cos ..)", C -> "amplitude (q .., k ..)" (the numbers are
  ``bias_q``/``bias_k`` resp. ``amplitude_q``/``amplitude_k`` of that head).  Where q or k is a single
  token (SVD's cross-attention keys) its whole value is its mean: X is then the other side's spread
  against it and is reported as "amplitude".  The cause names the dominant term whatever the size of
  the scores: ``risk`` says whether it matters.
"""
from __future__ import annotations

import math
from typing import Any

from ..rules import FP16_MAX

__all__ = ["RISK_RULE", "CAUSE_RULE", "judge", "layer_cause"]

RISK_RULE = (f"risk = max |q . k| / {FP16_MAX:g} (raw product over all calls); "
             f"overflows = any raw |q . k| > {FP16_MAX:g}")
CAUSE_RULE = ("on the dominant head (largest (M_q + A_q)(M_k + A_k)) the largest of R = M_q M_k |cos| "
              "(bias + resonance), X = M_q A_k + A_q M_k (bias without resonance), C = A_q A_k (amplitude); "
              "M = norm of the token mean, A = RMS norm of the centred tokens")


def judge(layer: dict[str, Any]) -> dict[str, Any]:
    """Set ``risk``, ``overflows``, ``cause`` and ``dominant_head`` of an aggregated layer (in place) and
    return it."""
    layer["risk"] = layer["max_abs_qk"] / FP16_MAX
    layer["overflows"] = layer["overflow_count"] > 0
    layer["cause"], layer["dominant_head"] = layer_cause(layer)
    return layer


def layer_cause(layer: dict[str, Any]) -> tuple[str, int | None]:
    """The cause text of an aggregated layer and its dominant head (see the module docstring)."""
    if not layer["calls"]:
        return "not called", None
    root_d = math.sqrt(layer["head_dim"])
    terms = []
    for h in range(layer["heads"]):
        m_q, m_k = layer["mean_norm_q"][h], layer["mean_norm_k"][h]
        a_q, a_k = layer["amplitude_q"][h] * root_d, layer["amplitude_k"][h] * root_d
        cos = layer["resonance_cos"][h]
        scale = (m_q + a_q) * (m_k + a_k)
        terms.append((scale, m_q * m_k * abs(cos), m_q * a_k + a_q * m_k, a_q * a_k))
    head = max(range(len(terms)), key=lambda i: terms[i][0])
    scale, res, cross, amp = terms[head]
    if scale == 0:
        return "zero q or k", head
    cos = layer["resonance_cos"][head]
    bias_q, bias_k = (_fmt_bias(layer[f"bias_{s}"][head]) for s in ("q", "k"))
    if res >= max(cross, amp):
        phase = "in-phase" if cos >= 0 else "anti-phase"
        return f"bias (q {bias_q}, k {bias_k}) + {phase} resonance (cos {cos:+.2f})", head
    single = layer["bias_q"][head] is None or layer["bias_k"][head] is None
    if cross >= amp and not single:
        return f"bias without resonance (q {bias_q}, k {bias_k}, cos {cos:+.2f})", head
    amp_q, amp_k = (_fmt_amp(layer, s, head) for s in ("q", "k"))
    return f"amplitude (q {amp_q}, k {amp_k})", head


def _fmt_bias(value: float | None) -> str:
    return "n/a (1 token)" if value is None else f"{value:.3g}"


def _fmt_amp(layer: dict[str, Any], side: str, head: int) -> str:
    return "1 token" if layer[f"bias_{side}"][head] is None else f"{layer[f'amplitude_{side}'][head]:.3g}"
