"""Overflow diagnosis of FP16 attention in any diffusers model: which layers overflow, and why.

One job per module, in the order the data flows:

- ``stats.py``: ``call_stats``, the statistics of one attention call (float32, blockwise, never N x N);
- ``collect.py``: a ``LayerRecorder`` keeps them for every call of one layer; ``recording(model,
  processor)`` installs the caller's processor, built around one recorder, on every attention module
  and restores the previous processors;
- ``aggregate.py``: per layer, the calls summarised (maxima, per-head means, per-step series, names);
- ``verdict.py``: the risk and cause of an aggregated layer;
- ``activations.py``: outside the scores, the largest |x| of each transformer block's attention output,
  feed-forward, norms and residual stream (forward hooks), against 65504;
- ``render.py``: the risk table, the activation table and ``write_diagnosis`` (``diagnosis.json`` and, from ``plots.py``, the
  heatmap and the bias/resonance figure).

The diagnosis installs no processor class of its own and never imports ``install`` or ``processors``:
the processor that feeds the recorders, the module kinds, and running a whole generation under the
diagnosis (the pipeline, its step callback, the timing of a plain run) are the application's
(``pasa_diffusers/pipelines/diagnose.py``).  The names below are imported on first use (PEP 562), so importing the
package loads none of its modules.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "call_stats": ".stats",
    "StepClock": ".collect", "LayerRecorder": ".collect", "recording": ".collect",
    "aggregate_layer": ".aggregate", "summarize": ".aggregate", "short_path": ".aggregate",
    "RISK_RULE": ".verdict", "CAUSE_RULE": ".verdict", "judge": ".verdict", "layer_cause": ".verdict",
    "ranked": ".render", "risk_table": ".render", "activation_table": ".render", "write_diagnosis": ".render",
    "ActivationSite": ".activations", "activation_sites": ".activations", "recording_activations": ".activations",
    "summarize_activations": ".activations",
}
__all__ = list(_HOMES)

if TYPE_CHECKING:
    from .activations import ActivationSite, activation_sites, recording_activations, summarize_activations
    from .aggregate import aggregate_layer, short_path, summarize
    from .collect import LayerRecorder, StepClock, recording
    from .render import activation_table, ranked, risk_table, write_diagnosis
    from .verdict import CAUSE_RULE, RISK_RULE, judge, layer_cause
    from .stats import call_stats


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'pasa_diffusers.diagnose' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
