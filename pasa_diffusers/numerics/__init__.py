"""The numerical study of the variants, split by job; every name is also importable from here.

- ``inputs.py``: the input generators (the paper's random benchmarks, the input classes, the stress cases);
- ``measures.py``: the error measures and the overflow margins;
- ``study.py``: the study runners (the paper's grid, the beta sweep, the stress cases) over every variant's
  reference;
- ``tables.py``: the results as markdown tables and a figure.
"""
from __future__ import annotations

from .inputs import (INPUT_CLASSES, PAPER_AMPLITUDES, PAPER_MEANS, PAPER_SEED, PAPER_SHAPE, QUICK_SHAPE, input_classes,
                     paper_inputs, resonance_inputs, stress_cases)
from .measures import (FP16_MAX, exact_half_overflow_margin, max_abs_error, max_score, nonfinite_count,
                       pasa_half_overflow_margin, rel_rmse, rel_rmse_v, rmse)
from .study import VARIANTS, StudyRow, beta_sweep, run_stress, run_study
from .tables import plot_error_vs_bias, study_table, stress_table, sweep_table

__all__ = [
    "paper_inputs",
    "resonance_inputs",
    "input_classes",
    "INPUT_CLASSES",
    "max_score",
    "pasa_half_overflow_margin",
    "exact_half_overflow_margin",
    "FP16_MAX",
    "rmse",
    "rel_rmse",
    "rel_rmse_v",
    "max_abs_error",
    "nonfinite_count",
    "VARIANTS",
    "stress_cases",
    "PAPER_MEANS",
    "PAPER_AMPLITUDES",
    "PAPER_SHAPE",
    "PAPER_SEED",
    "QUICK_SHAPE",
    "StudyRow",
    "run_study",
    "beta_sweep",
    "study_table",
    "sweep_table",
    "run_stress",
    "stress_table",
    "plot_error_vs_bias",
]
