"""The numerical study's results as markdown tables and a figure."""
from __future__ import annotations

from .study import StudyRow

__all__ = ["study_table", "sweep_table", "stress_table", "plot_error_vs_bias"]


def _fmt(x: float, nonfinite: int) -> str:
    return "NaN/inf" if nonfinite else f"{x:.2e}"


def study_table(rows: list[StudyRow], metric: str = "rel_rmse_v") -> str:
    """A markdown table: one line per input cell, one column per variant, plus max |q k^T|."""
    if metric not in ("rel_rmse_v", "rel_rmse", "max_abs"):
        raise ValueError(f"unknown metric={metric!r}")
    variants = list(dict.fromkeys(r.variant for r in rows))
    cells = list(dict.fromkeys((r.dist, r.mean, r.amplitude) for r in rows))
    by_key = {(r.dist, r.mean, r.amplitude, r.variant): r for r in rows}
    head = "| dist | mean | Am | max abs(qk) | " + " | ".join(variants) + " |"
    lines = [head, "|" + " --- |" * (4 + len(variants))]
    for dist, mean, amp in cells:
        first = by_key[(dist, mean, amp, variants[0])]
        vals = [_fmt(getattr(by_key[(dist, mean, amp, v)], metric), by_key[(dist, mean, amp, v)].nonfinite)
                for v in variants]
        lines.append(f"| {dist} | {mean:g} | {amp:g} | {first.max_abs_score:.3g} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    """A markdown table of :func:`beta_sweep`: one line per cell, one column per beta (relative RMSE)."""
    betas = list(dict.fromkeys(r["beta"] for r in rows))
    cells = list(dict.fromkeys((r["dist"], r["mean"], r["amplitude"]) for r in rows))
    by_key = {(r["dist"], r["mean"], r["amplitude"], r["beta"]): r for r in rows}
    lines = ["| dist | mean | Am | " + " | ".join(f"beta={b:.6g}" for b in betas) + " |",
             "|" + " --- |" * (3 + len(betas))]
    for cell in cells:
        vals = [_fmt(by_key[cell + (b,)]["rel_rmse"], by_key[cell + (b,)]["nonfinite"]) for b in betas]
        lines.append(f"| {cell[0]} | {cell[1]:g} | {cell[2]:g} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def stress_table(rows: list[dict]) -> str:
    """A markdown table of :func:`run_stress`: one line per case, one column per variant."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by_key = {(r["case"], r["variant"]): r for r in rows}
    lines = ["| case | " + " | ".join(variants) + " |", "|" + " --- |" * (1 + len(variants))]
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = []
        for name in variants:
            r = by_key[(case, name)]
            cells.append("n/a" if r["rel_rmse"] is None else _fmt(r["rel_rmse"], r["nonfinite"]))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_error_vs_bias(rows: list[StudyRow], path, *, dist: str = "uniform") -> None:
    """Relative RMSE against the input mean, one panel per amplitude, one line per variant (log scale;
    non-finite outputs are drawn as crosses at the top of the panel)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    amps = sorted({r.amplitude for r in rows if r.dist == dist})
    fig = Figure(figsize=(4.2 * len(amps), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(amps), sharey=True, squeeze=False)[0]
    variants = list(dict.fromkeys(r.variant for r in rows))
    top = max(r.rel_rmse for r in rows if r.dist == dist and r.nonfinite == 0) * 3
    for ax, amp in zip(axes, amps):
        for i, name in enumerate(variants):
            cell = sorted((r for r in rows if r.dist == dist and r.amplitude == amp and r.variant == name),
                          key=lambda r: r.mean)
            finite = [(r.mean, r.rel_rmse) for r in cell if r.nonfinite == 0]
            if finite:
                ax.plot(*zip(*finite), marker="o", label=name, color=f"C{i}")
            broken = [r.mean for r in cell if r.nonfinite]
            if broken:
                ax.plot(broken, [top] * len(broken), "x", color=f"C{i}", markersize=9)
        ax.set_yscale("log")
        ax.set_title(f"{dist}, Am {amp:g}")
        ax.set_xlabel("mean of q and k")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("RMSE / RMS(golden)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("error against bias (x at the top: non-finite output)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
