"""The report of an evaluation over samples: ``report.json``, ``report.md``, two plots and a terminal table.

``build_report`` turns the records of ``samples.jsonl`` (one per sample and backend, see
``pasa_diffusers/pipelines/compare.py``) into the report dict; ``write_report`` writes it; ``format_table`` prints it.

Report layout (``report.json``)::

    {"command", "versions", "model", "model_note": what the model is (built-in models) or null,
     "conditioning": what replaced a video transformer's text encoder (only for one),
     "reference": "fp32", "settings": {..., "images" (SVD) or "prompts" (a video transformer), "seeds", ...},
     "samples": n, "lpips": label or the reason it is missing, "statistics": stats.METHOD,
     "aggregate": {backend: {metric: {"mean", "std", "ci95": [lo, hi], "n"}}},
     "paired":    {"A - B": {metric: {"mean", "std", "ci95": [lo, hi], "n"}}},
     "health":    {backend: {"samples", "broken_samples", "frames", "nonfinite_frames",
                             "identical_samples", "fallbacks": {"calls", "fallback_calls", "share",
                                                                "reasons": {reason: calls},
                                                                "int8_blocks": {"blocks", "in_16_bits",
                                                                                "share"}},
                             "sparse": {"mask", "density", "schedule", "sparse_calls", "dense_calls"}}},
                                                                              # (a sparse backend's only)
     "per_frame": {backend: {"psnr": {"mean": [...], "ci95": [[lo, hi], ...], "n": [...]}}},
     "worst":     {backend: [{"sample", "image", "seed", "psnr", "ssim", "nonfinite_frames", "video"}]},
     "records": "samples.jsonl"}

Metrics (``METRICS``) are per-sample values: the mean over a video's frames of PSNR (dB), SSIM,
LPIPS and temporal PSNR, the flicker ratio, and the seconds the backend took.  A sample with no
finite frame has no value; a sample identical to the reference has PSNR ``inf`` (JSON ``"inf"``,
see ``records``).  Statistics are ``stats.summarize`` and ``stats.paired_difference``.  A backend
all of whose attention calls fell back to another computation is an error, not a row.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from . import stats
from .records import atomic_path, count, dumps, from_json_float, markdown_table, write_synced

__all__ = ["METRICS", "worst_key", "worst_records", "build_report", "write_report", "table_rows", "paired_rows",
           "verdict", "format_table", "format_markdown"]

METRICS: dict[str, tuple[str, str]] = {
    "psnr": ("PSNR dB", ".2f"),
    "ssim": ("SSIM", ".4f"),
    "lpips": ("LPIPS", ".4f"),
    "temporal_psnr": ("temporal PSNR dB", ".2f"),
    "flicker": ("flicker", ".3f"),
    "seconds": ("time s", ".1f"),
}
"""Per-sample metric -> (column title, number format)."""

HIGHER_IS_BETTER = {"psnr": True, "ssim": True, "lpips": False, "temporal_psnr": True}
"""The metrics compared pair by pair, and their direction."""

NA = "n/a"
MINUS = "\u2212"


def _value(record: dict[str, Any], metric: str) -> float:
    return from_json_float(record.get(metric))


def _fallbacks(backend: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    calls = sum(r["fallbacks"]["calls"] for r in records)
    fallback_calls = sum(r["fallbacks"]["fallback_calls"] for r in records)
    reasons: dict[str, int] = {}
    for record in records:
        for reason, count in record["fallbacks"]["reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + count
    if calls and fallback_calls == calls:
        raise ValueError(f"build_report: backend {backend!r} fell back on all {calls} attention calls it targets "
                         f"({', '.join(reasons)}): its videos are not {backend}'s")
    no_blocks = {"blocks": 0, "in_16_bits": 0}  # records written before the 8-bit backends counted them
    blocks = sum(r["fallbacks"].get("int8_blocks", no_blocks)["blocks"] for r in records)
    in_16_bits = sum(r["fallbacks"].get("int8_blocks", no_blocks)["in_16_bits"] for r in records)
    return {"calls": calls, "fallback_calls": fallback_calls, "share": fallback_calls / calls if calls else 0.0,
            "reasons": dict(sorted(reasons.items())),
            "int8_blocks": {"blocks": blocks, "in_16_bits": in_16_bits, "share": in_16_bits / blocks if blocks else None}}


def _sparse(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A sparse backend's mask over its records (``pipelines.sparse.sparse_summary``: the first record's mask,
    density and schedule, the calls added up), or ``None`` for a backend that runs no mask."""
    summaries = [r["sparse"] for r in records if r.get("sparse")]
    if not summaries:
        return None
    dense = sum((Counter(summary["dense_calls"]) for summary in summaries), Counter())
    first = summaries[0]
    return {"mask": first["mask"], "density": first["density"], "schedule": first["schedule"],
            "sparse_calls": sum(summary["sparse_calls"] for summary in summaries), "dense_calls": dict(dense)}


def worst_key(record: dict[str, Any]) -> tuple[int, float] | None:
    """How bad a record is, for the worst-samples list: ascending keys are worse first (most non-finite
    frames, then lowest PSNR); ``None`` for a video identical to the reference, never listed.  Ties
    keep the order of the samples."""
    psnr = _value(record, "psnr")
    if not record["nonfinite_frames"] and psnr == math.inf:
        return None
    return -record["nonfinite_frames"], -math.inf if math.isnan(psnr) else psnr


def worst_records(records: Sequence[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The ``count`` worst of one backend's ``records`` (in sample order) by ``worst_key``: those the report lists."""
    return sorted((r for r in records if worst_key(r) is not None), key=worst_key)[:count]


def _worst(records: list[dict[str, Any]], count: int, video: Callable[[dict[str, Any]], str]) -> list[dict]:
    """The report's entries of the ``count`` worst of ``records`` (``worst_records``)."""
    return [{"sample": r["sample"], "image": r["image"], "seed": r["seed"], "psnr": r["psnr"], "ssim": r["ssim"],
             "nonfinite_frames": r["nonfinite_frames"], "video": video(r)} for r in worst_records(records, count)]


def build_report(records: Sequence[dict[str, Any]], *, backends: Sequence[str], meta: dict[str, Any],
                 worst: int = 2, video: Callable[[dict[str, Any]], str] = lambda record: "") -> dict[str, Any]:
    """The report dict (module docstring) of ``records`` for ``backends`` (in that order).

    Args:
        records: one per (sample, backend); every backend must have a record for every sample.
        backends: the backends to report, in table order.
        meta: ``command``, ``versions``, ``model``, ``model_note`` (what the model is, in words, or None),
            ``settings`` and ``lpips`` (copied as they are), and for a video transformer ``conditioning``
            (what replaced its text encoder, in words).
        worst: how many worst samples to list per backend.
        video: the path (relative to the report) of a record's side-by-side video.
    """
    by_backend = {name: [r for r in records if r["backend"] == name] for name in backends}
    samples = [(r["image"], r["seed"]) for r in by_backend[backends[0]]] if backends else []
    for name, rows in by_backend.items():
        if [(r["image"], r["seed"]) for r in rows] != samples:
            raise ValueError(f"build_report: backend {name!r} has records for {len(rows)} samples, "
                             f"expected the same {len(samples)} samples as {backends[0]!r} in the same order")
    values = {name: {m: np.array([_value(r, m) for r in rows]) for m in METRICS} for name, rows in by_backend.items()}
    aggregate = {name: {m: stats.summarize(v) for m, v in per.items() if not np.isnan(v).all() or m != "lpips"}
                 for name, per in values.items()}
    paired: dict[str, dict[str, Any]] = {}
    for i, a in enumerate(backends):
        for b in backends[i + 1:]:
            paired[f"{a} - {b}"] = {m: stats.paired_difference(values[a][m], values[b][m])
                                    for m in HIGHER_IS_BETTER if m in aggregate[a] and m in aggregate[b]}
    health = {name: {"samples": len(rows),
                     "broken_samples": sum(1 for r in rows if r["nonfinite_frames"]),
                     "frames": sum(r["frames"] for r in rows),
                     "nonfinite_frames": sum(r["nonfinite_frames"] for r in rows),
                     "identical_samples": int(np.isposinf(values[name]["psnr"]).sum()),
                     "fallbacks": _fallbacks(name, rows),
                     **({"sparse": sparse} if (sparse := _sparse(rows)) else {})}
              for name, rows in by_backend.items()}
    per_frame = {name: {"psnr": stats.per_frame([[from_json_float(v) for v in r["psnr_per_frame"]] for r in rows])}
                 for name, rows in by_backend.items()}
    return {
        **{key: meta.get(key) for key in ("command", "versions", "model", "model_note")},
        **({"conditioning": meta["conditioning"]} if meta.get("conditioning") else {}),
        "reference": "fp32",
        "settings": meta.get("settings", {}),
        "samples": len(samples),
        "lpips": meta.get("lpips"),
        "statistics": stats.METHOD,
        "aggregate": aggregate,
        "paired": paired,
        "health": health,
        "per_frame": per_frame,
        "worst": {name: _worst(rows, worst, video) for name, rows in by_backend.items()},
        "records": "samples.jsonl",
    }


# ----------------------------------------------------------------------------------------------- tables


def _number(value: float, spec: str, sign: bool = False) -> str:
    text = format(value, ("+" if sign else "") + spec)
    return text.replace("-", MINUS)


def _summary_cell(summary: dict[str, Any] | None, spec: str, *, sign: bool = False, interval: bool = True) -> str:
    """``mean [lo, hi]``; ``inf`` for an infinite mean; ``n/a`` without a value."""
    if not summary or summary["mean"] is None:
        return NA
    mean = from_json_float(summary["mean"])
    if math.isinf(mean):
        return ("+" if sign and mean > 0 else "") + ("inf" if mean > 0 else f"{MINUS}inf")
    text = _number(mean, spec, sign)
    if interval and summary["ci95"] is not None:
        lo, hi = summary["ci95"]
        text += f" [{_number(lo, spec, sign)}, {_number(hi, spec, sign)}]"
    return text


def _columns(report: dict[str, Any]) -> list[str]:
    """The metrics with a value for some backend (LPIPS only when it was computed)."""
    return [m for m in METRICS if any(m in per for per in report["aggregate"].values())]


def _nonfinite_cell(health: dict[str, Any]) -> str:
    cell = f"{health['broken_samples']} of {health['samples']}"
    if health["nonfinite_frames"]:
        cell += f" ({health['nonfinite_frames']} frames)"
    return cell


def _fallback_cell(fallbacks: dict[str, Any]) -> str:
    """``0%``, or the share of calls that fell back and each reason's share, e.g. ``50% (single key)``; for
    the 8-bit backends (pasa-int8, pasa-fp8) also the share of their key blocks computed in 16 bits, e.g.
    ``0%; 16-bit key blocks 3%``."""
    blocks = fallbacks["int8_blocks"]
    int8 = f"; 16-bit key blocks {100 * blocks['share']:.0f}%" if blocks["blocks"] else ""
    if not fallbacks["fallback_calls"]:
        return "0%" + int8
    calls = fallbacks["calls"]
    share = f"{100 * fallbacks['share']:.0f}%"
    reasons = fallbacks["reasons"]
    if len(reasons) == 1:
        return f"{share} ({next(iter(reasons))})" + int8
    return share + " (" + ", ".join(f"{reason} {100 * n / calls:.0f}%" for reason, n in reasons.items()) + ")" + int8


def _on_cpu(report: dict[str, Any]) -> bool:
    return report["settings"].get("device") == "cpu"


def _title(report: dict[str, Any], metric: str) -> str:
    """The column title of ``metric``; times measured on a CPU say so (``CPU time s``)."""
    return "CPU time s" if metric == "seconds" and _on_cpu(report) else METRICS[metric][0]


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The scores table: ``(columns, rows)``, one row per backend."""
    metrics = _columns(report)
    columns = ["backend", *(_title(report, m) for m in metrics), "samples with non-finite frames",
               "attention fallbacks"]
    rows = []
    for name, per in report["aggregate"].items():
        health = report["health"][name]
        cells = []
        for m in metrics:
            cell = _summary_cell(per.get(m), METRICS[m][1], interval=m != "seconds")
            if m == "psnr" and health["identical_samples"]:
                cell += f" ({health['identical_samples']} of {health['samples']} identical)"
            cells.append(cell)
        rows.append([name, *cells, _nonfinite_cell(health), _fallback_cell(health["fallbacks"])])
    return columns, rows


def _verdict(pair: str, summary: dict[str, Any] | None, higher_is_better: bool) -> str:
    a, _, b = pair.partition(" - ")
    if not summary or summary["mean"] is None:
        return NA
    mean = from_json_float(summary["mean"])
    if math.isinf(mean):
        positive = mean > 0
    elif summary["ci95"] is None:
        return "one sample: no interval"
    elif summary["ci95"][0] > 0 or summary["ci95"][1] < 0:
        positive = summary["ci95"][0] > 0
    else:
        return "within noise (interval holds 0)"
    return f"{a if positive == higher_is_better else b} better"


def paired_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The paired-differences table: ``(columns, rows)``, one row per pair ``A - B``."""
    metrics = [m for m in HIGHER_IS_BETTER if m in _columns(report)]
    columns = ["A \u2212 B", "samples", *(METRICS[m][0] for m in metrics), "PSNR verdict"]
    rows = []
    for pair, per in report["paired"].items():
        if _pair_size(per):
            rows.append([pair.replace(" - ", f" {MINUS} "), str(per["psnr"]["n"]),
                         *(_summary_cell(per.get(m), METRICS[m][1], sign=True) for m in metrics),
                         _verdict(pair, per["psnr"], True)])
    return columns, rows


def _pair_size(per: dict[str, Any]) -> int:
    """The samples where both backends of a pair have a PSNR."""
    return per["psnr"]["n"] if "psnr" in per else 0


def _unpaired_note(report: dict[str, Any]) -> str:
    """The pairs left out of the paired table: no sample where both backends have a value."""
    empty = [pair.replace(" - ", f" {MINUS} ") for pair, per in report["paired"].items() if not _pair_size(per)]
    return f"Not shown, no sample where both have a finite PSNR: {', '.join(empty)}." if empty else ""


def _aligned(columns: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(columns, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(columns), "  ".join("-" * w for w in widths), *(line(row) for row in rows)])


def format_table(report: dict[str, Any]) -> str:
    """The scores and the paired differences as aligned plain-text tables, then the verdict, for the terminal."""
    text = (f"Scores against the fp32 reference over {count(report['samples'], 'sample')}: {_what_is_shown(report)}\n"
            + _aligned(*table_rows(report)))
    columns, rows = paired_rows(report)
    if rows:
        text += f"\n\nPaired differences A \u2212 B over the same samples: {_what_is_shown(report)}\n"
        text += _aligned(columns, rows)
    note = _unpaired_note(report)
    text += ("\n" + note) if note else ""
    return text + "\n\nVerdict:\n" + "\n".join(f"- {sentence}" for sentence in verdict(report))


# ------------------------------------------------------------------------------------------------- verdict

FIRM_SAMPLES = 10
"""Below this many samples the percentile bootstrap interval is too narrow: the verdict says to read it as a guide."""

def _what_is_shown(report: dict[str, Any]) -> str:
    """What a table's cells hold: a mean and its interval, or for a run of one sample its value alone (one value
    has no bootstrap interval, and the tables show none)."""
    if report["samples"] > 1:
        return "mean [95% bootstrap interval]"
    return "the one sample's value (no interval from one sample)"


FALLBACK_CASES = "a single key, where softmax is exactly 1; an attention mask, computed by PyTorch's SDPA"
"""The documented cases in which a PASA processor computes a call another way (``install.fallback_summary``)."""


def _join(names: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _db(value: float, sign: bool = False) -> str:
    return _number(value, ".2f", sign)


def _finiteness(report: dict[str, Any]) -> str:
    """Which backends give non-finite frames (how many), and which stay finite."""
    health = report["health"]
    broken = [name for name, h in health.items() if h["nonfinite_frames"]]
    finite = [name for name in health if name not in broken]
    parts = [f"{name} gives non-finite (NaN or inf) frames in {health[name]['broken_samples']} of "
             f"{count(health[name]['samples'], 'sample')} ({health[name]['nonfinite_frames']} of "
             f"{count(health[name]['frames'], 'frame')}), which no score counts" for name in broken]
    if finite:
        subject = _join(finite) if broken else "every backend"
        parts.append(f"{subject} {'stay' if broken and len(finite) > 1 else 'stays'} finite in every frame")
    return "; ".join(parts) + "."


def _identical(report: dict[str, Any]) -> list[str]:
    """The backends whose videos equal the reference's on some samples (PSNR inf)."""
    sentences = []
    for name, h in report["health"].items():
        if h["identical_samples"]:
            where = "every sample" if h["identical_samples"] == h["samples"] else \
                f"{h['identical_samples']} of {count(h['samples'], 'sample')}"
            sentences.append(f"{name} is identical to FP32 on {where} (PSNR inf).")
    return sentences


def _pair_sentence(pair: str, summary: dict[str, Any] | None) -> str | None:
    """The PSNR difference ``A - B`` in words, with its interval; None when no sample has both values."""
    a, _, b = pair.partition(" - ")
    if not summary or summary["mean"] is None:
        return None
    mean, n = from_json_float(summary["mean"]), summary["n"]
    if math.isinf(mean):
        better, other = (a, b) if mean > 0 else (b, a)
        return f"{better} is identical to FP32 on a sample where {other} is not (an infinite PSNR difference)."
    if summary["ci95"] is None:
        return f"{a} {MINUS} {b} is {_db(mean, True)} dB of PSNR on the one sample where both have one: no interval."
    lo, hi = summary["ci95"]
    if lo <= 0 <= hi:
        return (f"{a} and {b} cannot be told apart: {a} {MINUS} {b} is {_db(mean, True)} dB of PSNR (95 % CI "
                f"{_db(lo, True)} to {_db(hi, True)}, which holds 0) over {count(n, 'sample')}.")
    better, other, gap, lo, hi = (a, b, mean, lo, hi) if lo > 0 else (b, a, -mean, -hi, -lo)
    return (f"{better} is {_db(gap)} dB (95 % CI {_db(lo)} to {_db(hi)}) closer to FP32 than {other} in PSNR, "
            f"over {count(n, 'sample')}.")


def _single_backend(report: dict[str, Any]) -> list[str]:
    """With one backend there is no pair: its mean PSNR and interval."""
    if len(report["aggregate"]) != 1:
        return []
    name, per = next(iter(report["aggregate"].items()))
    summary = per.get("psnr")
    if not summary or summary["mean"] is None or math.isinf(from_json_float(summary["mean"])):
        return []
    interval = f" (95 % CI {_db(summary['ci95'][0])} to {_db(summary['ci95'][1])})" if summary["ci95"] else ""
    return [f"{name} has a PSNR of {_db(from_json_float(summary['mean']))} dB{interval} against FP32 over "
            f"{count(summary['n'], 'sample')}."]


def verdict(report: dict[str, Any]) -> list[str]:
    """What the report finds, in sentences computed from its health and its paired PSNR differences: which
    backends give non-finite frames, which stay finite, and how far apart each pair is (with its interval)."""
    sentences = [_finiteness(report), *_identical(report)]
    sentences += [text for pair, per in report["paired"].items() if (text := _pair_sentence(pair, per.get("psnr")))]
    sentences += _single_backend(report)
    more = "seeds" if "prompts" in report["settings"] else "images or seeds"
    if report["samples"] == 1:
        sentences.append(f"With 1 sample there is no interval, so no difference is resolved; more {more} give one "
                         f"(about {FIRM_SAMPLES} make it firm).")
    elif report["samples"] < FIRM_SAMPLES:
        sentences.append(f"With {count(report['samples'], 'sample')} read the intervals as a rough guide (below about "
                         f"{FIRM_SAMPLES} the bootstrap interval is too narrow); more {more} make them firm.")
    return sentences


def _fallback_note(report: dict[str, Any]) -> str:
    """The fallback column in one line: what a fallback is, and why half of SVD's calls are one."""
    text = ("Attention fallbacks: the share of the attention calls a backend targets that it did not compute itself "
            f"but computed exactly another way, in documented cases only ({FALLBACK_CASES}), with the reason.")
    if any("single key" in h["fallbacks"]["reasons"] for h in report["health"].values()):
        text += (" In SVD's UNet every transformer block has one self-attention and one cross-attention to the "
                 "image embedding, a single key, so 50 % is expected of the backends that run the PASA op (the "
                 "pasa variants and naive-half).")
    if any(h["fallbacks"]["int8_blocks"]["blocks"] for h in report["health"].values()):
        text += (" 16-bit key blocks: the share of pasa-int8's or pasa-fp8's (batch, head, 128-key block) tiles it "
                 "computed in 16 bits because an 8-bit code could not hold their range (docs/NUMERICS.md, \"The "
                 "16-bit blocks\"); those calls are the 8-bit backend's own, not fallbacks.")
    return text


def _sparse_notes(report: dict[str, Any]) -> list[str]:
    """Per sparse backend its mask in one line: the mask, its density, and how many self-attention calls ran it."""
    notes = []
    for name, health in report["health"].items():
        sparse = health.get("sparse")
        if not sparse:
            continue
        dense = sum(sparse["dense_calls"].values())
        kept = "" if sparse["density"] is None else f", density {sparse['density']:.3f}"
        notes.append(f"{name}: block-sparse mask {sparse['mask']}{kept} on {sparse['sparse_calls']} of "
                     f"{sparse['sparse_calls'] + dense} self-attention calls (dense for the first "
                     f"{sparse['schedule']['dense_steps']} steps and {sparse['schedule']['dense_layers']} layers).")
    return notes


def _timing_note(report: dict[str, Any]) -> list[str]:
    """On a CPU: the times are CPU times, which say nothing about GPU speed."""
    if not _on_cpu(report):
        return []
    threads = report["settings"].get("cpu_threads")
    where = f"this CPU ({count(threads, 'thread')})" if threads else "this CPU"
    return [f"Times are seconds per video on {where}. CPU times say nothing about GPU speed: on the CPU the PASA "
            "backends run their exact PyTorch reference, not the Triton kernels."]


# ------------------------------------------------------------------------------------------------ markdown


def _intro(report: dict[str, Any]) -> list[str]:
    """What was compared, on what model and samples, what conditioned them, and what the model is."""
    s, names = report["settings"], list(report["aggregate"])
    if "prompts" in s:  # a video transformer: text to video from fixed prompt embeddings
        samples, sample = count(len(s["prompts"]), "prompt"), "one video generated from one prompt and one seed's noise"
    else:
        samples, sample = count(len(s["images"]), "image"), "one image animated from one seed's noise"
    lines = [f"Compared: the attention backend{'s' if len(names) > 1 else ''} {_join(names)}, each against FP32 "
             f"attention (`{report['reference']}`, the reference), in the model `{report['model']}`, on "
             f"{count(report['samples'], 'sample')} = {samples} x {count(len(s['seeds']), 'seed')}. Each sample is "
             f"{sample} by the reference and by every backend: only attention differs.",
             "", f"{count(s['num_frames'], 'frame')} of {s['height']}x{s['width']}, "
             f"{count(s['num_inference_steps'], 'step')}; {s['device']}"
             + (f" ({count(s['cpu_threads'], 'thread')})" if "cpu_threads" in s else "")
             + f", model in {s['dtype']}."]
    if report.get("model_note"):
        lines += ["", f"The model: `{report['model']}` is {report['model_note']}."]
    if report.get("conditioning"):
        lines += ["", f"The prompt: {report['conditioning']}."]
    return lines


def _worst_section(report: dict[str, Any]) -> list[str]:
    rows = [[name, w["sample"], _summary_cell({"mean": w["psnr"], "ci95": None}, ".2f"),
             _summary_cell({"mean": w["ssim"], "ci95": None}, ".4f"), str(w["nonfinite_frames"]),
             f"![{w['sample']} {name}]({w['video']})" if w["video"] else NA]
            for name, entries in report["worst"].items() for w in entries]
    if not rows:
        return []
    return ["", "## Worst samples", "",
            "Per backend, the samples with the most non-finite frames, then the lowest PSNR; each video is "
            "[fp32 reference | backend | 10x absolute difference] (magenta: non-finite pixels).", "",
            markdown_table(["backend", "sample", "PSNR dB", "SSIM", "non-finite frames", "side by side"], rows,
                           align="llrrrl")]


def format_markdown(report: dict[str, Any], plots: Sequence[str] = ()) -> str:
    """The markdown report: what was compared on what model, the verdict in words, scores (with what a fallback
    is, and CPU times marked), paired differences, worst samples, plots, method, settings."""
    lines = [f"# pasa compare: {report['model']}, {count(report['samples'], 'sample')}", "", *_intro(report), "",
             "## Verdict", "", *(f"- {sentence}" for sentence in verdict(report)), "",
             "## Scores against the fp32 reference", "",
             ("Mean over samples [95% bootstrap interval]" if report["samples"] > 1 else
              _what_is_shown(report).capitalize()) + "; a sample's score is the mean over its frames (frames with "
             "non-finite pixels are left out and counted).", "",
             markdown_table(*table_rows(report)), ""]
    if report["lpips"] and "unavailable" in report["lpips"]:
        lines += [report["lpips"], ""]
    lines += ["Temporal PSNR compares frame differences (data range 2); flicker is the mean frame change of the "
              "backend over the reference's.", "", _fallback_note(report)]
    for note in _sparse_notes(report) + _timing_note(report):
        lines += ["", note]
    columns, rows = paired_rows(report)
    note = _unpaired_note(report)
    if rows or note:
        lines += ["", "## Paired differences", "",
                  "A \u2212 B per sample, then the mean [95% bootstrap interval] over the samples where both have "
                  "a value. An interval that excludes 0 resolves the difference; one that holds 0 does not."
                  if report["samples"] > 1 else "A \u2212 B on the one sample: no interval, so no difference is "
                  "resolved.", ""]
        lines += [markdown_table(columns, rows, align="lr" + "r" * (len(columns) - 3) + "l")] if rows else []
        lines += ["", note] if note else []
    lines += _worst_section(report)
    if plots:
        lines += ["", "## Plots", "", *(f"![{Path(p).stem}]({p})" for p in plots)]
    lines += ["", "## Method", "", report["statistics"] + ".", "",
              f"Per-sample records: [{report['records']}]({report['records']}).",
              "", "## Settings", "", "```json", dumps(report["settings"], indent=None), "```",
              "", "## Command", "", "```", str(report["command"]), "```",
              "", "## Versions", "", *(f"- {k}: {v}" for k, v in (report["versions"] or {}).items())]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------- plots


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _distributions(report: dict[str, Any], records: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per backend, every sample's PSNR and SSIM (box and points); identical samples drawn at a cap."""
    names = list(report["aggregate"])
    fig = _figure(4.0 + 1.2 * len(names), 4.0)
    rng = np.random.default_rng(0)  # jitter of the points only
    for panel, metric in enumerate(("psnr", "ssim")):
        ax = fig.add_subplot(1, 2, panel + 1)
        values = {n: np.array([_value(r, metric) for r in records if r["backend"] == n]) for n in names}
        finite = np.concatenate([v[np.isfinite(v)] for v in values.values()] + [np.empty(0)])
        cap = math.ceil(finite.max() + 5) if finite.size else 100.0
        capped = False
        for i, name in enumerate(names):
            v = values[name][~np.isnan(values[name])]
            if not v.size:
                ax.text(i, 0.5, "no finite\nsample", transform=ax.get_xaxis_transform(), ha="center", va="center",
                        fontsize=8, color="0.4")
                continue
            capped |= bool(np.isinf(v).any())
            v = np.where(np.isinf(v), cap, v)
            ax.boxplot([v], positions=[i], widths=0.5, showfliers=False)
            ax.scatter(i + rng.uniform(-0.15, 0.15, v.size), v, s=12, alpha=0.7, zorder=3)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_xlim(-0.6, len(names) - 0.4)
        title = METRICS[metric][0] + " per sample"
        ax.set_title(title + (f"\n(identical to fp32 drawn at {cap:g})" if capped else ""), fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{report['model']}: {count(report['samples'], 'sample')} against the fp32 reference", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _per_frame_plot(report: dict[str, Any], path: Path) -> Path:
    """Per backend, the mean over samples of each frame's PSNR, with its 95% bootstrap band."""
    fig = _figure(7.0, 4.0)
    ax = fig.add_subplot()
    left_out = []
    for name, per in report["per_frame"].items():
        mean = np.array([from_json_float(m) if m is not None else math.nan for m in per["psnr"]["mean"]])
        if not np.isfinite(mean).any():
            left_out.append(name)
            continue
        frames = np.arange(mean.size)
        line, = ax.plot(frames, np.where(np.isfinite(mean), mean, np.nan), marker="o", markersize=3, label=name)
        band = [(t, ci) for t, ci in enumerate(per["psnr"]["ci95"]) if ci is not None]
        if band:
            ax.fill_between([t for t, _ in band], [ci[0] for _, ci in band], [ci[1] for _, ci in band],
                            color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("frame index")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("PSNR (dB)")
    title = f"PSNR per frame vs fp32: mean over {count(report['samples'], 'sample')}, 95% bootstrap band"
    if left_out:
        title += f"\n(not drawn, no finite mean: {', '.join(left_out)})"
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def write_report(report: dict[str, Any], records: Sequence[dict[str, Any]], out_dir: str | Path) -> dict[str, Path]:
    """Write ``distributions.png``, ``psnr_per_frame.png``, ``report.md`` and ``report.json``.

    Every file is first written to a temporary name beside its target; only when all four are complete
    are they renamed onto the targets, ``report.json`` last.  So the report of an earlier run stays
    whole until the new one replaces it, a failure leaves it untouched, and ``report.json`` is never
    newer than the rest.  Returns ``{"distributions", "psnr_per_frame", "markdown", "json"}`` -> path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md",
             "psnr_per_frame": out / "psnr_per_frame.png", "distributions": out / "distributions.png"}
    with contextlib.ExitStack() as renames:  # closed in reverse: the plots, then report.md, then report.json
        tmp = {kind: renames.enter_context(atomic_path(path)) for kind, path in paths.items()}
        _distributions(report, records, tmp["distributions"])
        _per_frame_plot(report, tmp["psnr_per_frame"])
        write_synced(tmp["markdown"], format_markdown(report, [paths["distributions"].name,
                                                               paths["psnr_per_frame"].name]))
        write_synced(tmp["json"], dumps(report) + "\n")
    return {kind: paths[kind] for kind in ("distributions", "psnr_per_frame", "markdown", "json")}
