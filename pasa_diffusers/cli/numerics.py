"""``pasa numerics``: the paper's random-input accuracy study of every attention variant."""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

from .common import FOLDER, check_out_dir

__all__ = ["add_parser", "validate", "run"]


def _progress(desc: str, unit: str = "cell"):
    """A progress bar on stderr over a phase's items (each phase of the run has one: none is silent)."""
    from tqdm.auto import tqdm

    return lambda items: tqdm(list(items), desc=desc, unit=unit, file=sys.stderr)


def _write_rows(rows: list[dict], out: Path, stem: str) -> None:
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=2))


def validate(args: argparse.Namespace) -> None:
    """Refuse an output folder that cannot be written before the study runs."""
    check_out_dir(args.out)


def run(args: argparse.Namespace) -> int:
    from .. import numerics
    from ..shift_matrix import optimal_beta

    shape = numerics.QUICK_SHAPE if args.quick else numerics.PAPER_SHAPE
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    v_mean = 0.0 if args.zero_mean_v else None
    rows = numerics.run_study(shape=shape, v_mean=v_mean, progress=_progress("numerics"))
    betas = [0.5] + [optimal_beta(start=1 - 2.0 ** -e) for e in (4, 5, 6)]
    sweep_cells = [("uniform", 0.0, 5.0), ("uniform", 10.0, 0.5), ("uniform", 30.0, 0.5), ("hybrid", 30.0, 10.0)]
    sweep = numerics.beta_sweep(betas, sweep_cells, shape=shape, v_mean=v_mean,
                                progress=_progress("beta sweep (PASA half)", "run"))
    stress = numerics.run_stress(progress=_progress("stress cases", "run"))
    seconds = time.perf_counter() - start

    _write_rows([r.as_dict() for r in rows], out, "numerics")
    _write_rows(sweep, out, "beta_sweep")
    _write_rows(stress, out, "stress")
    numerics.plot_error_vs_bias(rows, out / "error_vs_bias.png")
    paper_table = numerics.study_table(rows, "rel_rmse_v")
    output_table = numerics.study_table(rows, "rel_rmse")
    sweep_table = numerics.sweep_table(sweep)
    command = ("pasa numerics" + (" --quick" if args.quick else "") + (" --zero-mean-v" if args.zero_mean_v else "")
               + f" --out {args.out}")
    v_note = ", zero-mean V ~ N(0, 1)" if args.zero_mean_v else ""
    text = (f"# PASA numerics ({command}{v_note})\n\nshape (B, Hq, Hk, N, D) = {shape}, fp16 inputs, seed "
            f"{numerics.PAPER_SEED}, {seconds:.0f} s\n\n"
            f"## RMSE / RMS(V) (the paper's metric)\n\n{paper_table}\n\n"
            f"## RMSE / RMS(golden output)\n\n{output_table}\n\n"
            f"## PASA half: RMSE / RMS(golden output) against beta\n\n{sweep_table}\n\n"
            f"## Stress cases (1, 2, 1, 300, 128), V ~ N(0, 1): RMSE / RMS(golden output)\n\n"
            f"{numerics.stress_table(stress)}\n\n![error against bias](error_vs_bias.png)\n")
    (out / "numerics.md").write_text(text)
    print(text)
    print(f"wrote {out / 'numerics.md'}, numerics.csv/json, beta_sweep.csv/json, stress.csv/json, "
          "error_vs_bias.png")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("numerics", help="the paper's random-input accuracy study of every attention variant",
                       description="Run the paper's random-input accuracy grid (distribution x mean x amplitude) "
                                   "for every attention variant, a beta sweep and stress cases, against a float64 "
                                   "reference; write numerics.md, CSV and JSON tables and a plot into --out.")
    p.add_argument("--quick", action="store_true",
                   help="a smaller shape (1, 4, 1, 391, 128) instead of the paper's (1, 28, 4, 1407, 128)")
    p.add_argument("--zero-mean-v", action="store_true",
                   help="draw V ~ N(0, 1) instead of like q and k (errors in the weights are not hidden by V's mean)")
    p.add_argument("--out", type=FOLDER, default="out/numerics",
                   help="output folder (CSV, JSON, markdown; default out/numerics)")
    p.set_defaults(func=run)
