"""Statistics over samples (metrics.stats) against direct computations, and the report built from records."""
from __future__ import annotations

import json
import math
import statistics

import imageio.v3 as iio
import numpy as np
import pytest

from pasa_diffusers.metrics import stats
from pasa_diffusers.metrics.records import (dumps, from_json_float, json_float, json_safe, markdown_table,
                                            write_atomic)
from pasa_diffusers.metrics import report as report_module
from pasa_diffusers.metrics.report import build_report, format_markdown, format_table, paired_rows, table_rows, \
    verdict, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def percentile(sorted_values: list[float], q: float) -> float:
    """numpy's default ('linear') percentile, written out."""
    position = (len(sorted_values) - 1) * q / 100
    below = math.floor(position)
    above = min(below + 1, len(sorted_values) - 1)
    return sorted_values[below] + (sorted_values[above] - sorted_values[below]) * (position - below)


def direct_summary(values: list[float]) -> dict:
    """The documented method, one resample at a time in plain Python."""
    kept = [v for v in values if not math.isnan(v)]
    draws = np.random.default_rng(stats.SEED).integers(0, len(kept), size=(stats.RESAMPLES, len(kept)))
    means = sorted(statistics.fmean(kept[i] for i in row) for row in draws.tolist())
    return {"mean": statistics.fmean(kept), "std": statistics.stdev(kept),
            "ci95": [percentile(means, 2.5), percentile(means, 97.5)], "n": len(kept)}


@pytest.mark.parametrize("n", [2, 5, 17])
def test_summarize_matches_a_direct_computation(n, gen):
    values = (30 + 5 * np.random.default_rng(int(gen.initial_seed())).standard_normal(n)).tolist()
    got, want = stats.summarize(values), direct_summary(values)
    assert got["n"] == want["n"] == n
    for key in ("mean", "std"):
        assert got[key] == pytest.approx(want[key], rel=1e-12)
    assert got["ci95"] == pytest.approx(want["ci95"], rel=1e-12)
    assert got["ci95"][0] <= got["mean"] <= got["ci95"][1]
    assert stats.summarize(values) == got, "the interval must be reproducible"


def test_bootstrap_in_chunks_equals_one_draw(monkeypatch):
    values = np.linspace(0.0, 1.0, 7) ** 2
    whole = stats.bootstrap_ci(values)
    monkeypatch.setattr(stats, "_CHUNK", 7 * 3)  # 3 resamples per draw
    assert stats.bootstrap_ci(values) == whole


def test_summarize_missing_infinite_and_single_values():
    with_missing = [31.0, math.nan, 29.0, 33.5]
    assert stats.summarize(with_missing) == stats.summarize([31.0, 29.0, 33.5])
    assert stats.summarize(with_missing)["n"] == 3
    assert stats.summarize([math.nan, math.nan]) == {"mean": None, "std": None, "ci95": None, "n": 0}
    assert stats.summarize([12.5]) == {"mean": 12.5, "std": None, "ci95": None, "n": 1}
    assert stats.summarize([math.inf, 40.0]) == {"mean": math.inf, "std": None, "ci95": None, "n": 2}


def test_paired_difference_matches_a_direct_computation():
    a = [40.0, 42.5, math.nan, 39.0, 44.0, 41.0]
    b = [30.0, 33.0, 31.0, math.nan, 32.5, 35.0]
    got = stats.paired_difference(a, b)
    want = direct_summary([x - y for x, y in zip(a, b) if not (math.isnan(x) or math.isnan(y))])
    assert got["n"] == 4
    assert got["mean"] == pytest.approx(want["mean"]) and got["std"] == pytest.approx(want["std"])
    assert got["ci95"] == pytest.approx(want["ci95"])
    assert stats.paired_difference([math.inf, 3.0], [math.inf, 1.0]) == {"mean": 2.0, "std": None, "ci95": None,
                                                                         "n": 1}
    with pytest.raises(ValueError, match="aligned"):
        stats.paired_difference([1.0, 2.0], [1.0])


def test_per_frame_summarizes_each_column():
    matrix = [[30.0, 31.0, math.nan], [32.0, 35.0, 20.0], [34.0, 30.0, 22.0]]
    got = stats.per_frame(matrix)
    assert got["n"] == [3, 3, 2]
    assert got["mean"] == pytest.approx([32.0, 32.0, 21.0])
    assert got["ci95"][0] == pytest.approx(direct_summary([30.0, 32.0, 34.0])["ci95"])


def test_records_json_convention_and_tables(tmp_path):
    converted = json_safe({"a": np.float32(np.inf), "b": [float("nan"), -np.inf], "c": np.arange(2), tmp_path: 1})
    assert converted == {"a": "inf", "b": [None, "-inf"], "c": [0, 1], str(tmp_path): 1}
    assert [from_json_float(json_float(v)) for v in (1.5, math.inf, -math.inf)] == [1.5, math.inf, -math.inf]
    assert math.isnan(from_json_float(json_float(math.nan)))
    with pytest.raises(ValueError, match="expected a number"):
        from_json_float("Infinity")
    assert json.loads(dumps({"x": math.nan})) == {"x": None}
    assert markdown_table(["a", "b|c"], [["x", 1]]) == "| a | b\\|c |\n|---|---:|\n| x | 1 |"
    with pytest.raises(ValueError, match="row 0 has 1 cells"):
        markdown_table(["a", "b"], [["x"]])
    path = write_atomic(tmp_path / "f.txt", "hello")
    assert path.read_text() == "hello" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


# ----------------------------------------------------------------------------------------------- the report

BACKENDS = ("pasa", "naive-half", "bf16")
SAMPLES = [("builtin:rocket", 0), ("builtin:rocket", 1), ("builtin:coffee", 0), ("builtin:coffee", 1)]
PSNR = {"pasa": [44.0, 41.5, 43.0, 45.25], "bf16": [33.0, 34.5, 31.0, 36.0]}


def record(image: str, seed: int, backend: str, index: int) -> dict:
    broken = backend == "naive-half"
    psnr = math.nan if broken else PSNR[backend][index]
    per_frame = [None, None] if broken else [psnr - 0.5, psnr + 0.5]
    calls, fell = (96, 0) if backend == "bf16" else (96, 48)
    return json_safe({"image": image, "seed": seed, "sample": f"{image[8:]}-seed{seed}", "backend": backend,
                      "psnr": psnr, "ssim": math.nan if broken else 1 - (50 - psnr) / 100, "lpips": math.nan,
                      "temporal_psnr": math.nan if broken else psnr + 2, "flicker": math.nan if broken else 1.0,
                      "frames": 2, "nonfinite_frames": 2 if broken else 0, "first_nonfinite": 0 if broken else None,
                      "identical_frames": 0, "psnr_per_frame": per_frame, "ssim_per_frame": [None, None],
                      "fallbacks": {"calls": calls, "fallback_calls": fell,
                                    "reasons": {"single key": fell} if fell else {}},
                      "seconds": 0.25 + index, "rank": 0})


def make_records() -> list[dict]:
    return [record(image, seed, b, i) for i, (image, seed) in enumerate(SAMPLES) for b in BACKENDS]


META = {"command": "pasa compare --seeds 0-1", "versions": {"torch": "x"}, "model": "tiny-resonant",
        "lpips": "LPIPS unavailable: no weights",
        "settings": {"images": ["builtin:rocket", "builtin:coffee"], "seeds": [0, 1], "num_frames": 2, "height": 16,
                     "width": 16, "num_inference_steps": 1, "device": "cpu", "dtype": "float32"}}


def video(r: dict) -> str:
    return f"videos/{r['sample']}_{r['backend']}.gif"


def test_aggregate_and_paired_equal_direct_computations():
    report = build_report(make_records(), backends=BACKENDS, meta=META, worst=1, video=video)
    assert report["samples"] == 4 and report["statistics"] == stats.METHOD
    pasa = report["aggregate"]["pasa"]
    assert set(pasa) == {"psnr", "ssim", "temporal_psnr", "flicker", "seconds"}, "LPIPS has no value: no entry"
    for key, value in direct_summary(PSNR["pasa"]).items():
        assert pasa["psnr"][key] == pytest.approx(value)
    assert report["aggregate"]["naive-half"]["psnr"] == {"mean": None, "std": None, "ci95": None, "n": 0}
    diff = report["paired"]["pasa - bf16"]["psnr"]
    want = direct_summary([a - b for a, b in zip(PSNR["pasa"], PSNR["bf16"])])
    assert diff["mean"] == pytest.approx(want["mean"]) and diff["ci95"] == pytest.approx(want["ci95"])
    assert report["paired"]["pasa - naive-half"]["psnr"]["n"] == 0
    assert report["per_frame"]["pasa"]["psnr"]["mean"] == pytest.approx([np.mean(PSNR["pasa"]) - 0.5,
                                                                          np.mean(PSNR["pasa"]) + 0.5])
    health = report["health"]
    assert health["naive-half"]["broken_samples"] == 4 and health["naive-half"]["nonfinite_frames"] == 8
    assert health["pasa"]["fallbacks"] == {"calls": 384, "fallback_calls": 192, "share": 0.5,
                                           "reasons": {"single key": 192},
                                           "int8_blocks": {"blocks": 0, "in_16_bits": 0, "share": None}}
    assert report["worst"]["pasa"] == [{"sample": "rocket-seed1", "image": "builtin:rocket", "seed": 1, "psnr": 41.5,
                                        "ssim": pytest.approx(0.915), "nonfinite_frames": 0,
                                        "video": "videos/rocket-seed1_pasa.gif"}]
    assert report["worst"]["naive-half"][0]["nonfinite_frames"] == 2


def test_tables_show_intervals_fallbacks_and_verdicts():
    report = build_report(make_records(), backends=BACKENDS, meta=META, video=video)
    columns, rows = table_rows(report)
    assert columns[:2] == ["backend", "PSNR dB"] and "LPIPS" not in columns and columns[-1] == "attention fallbacks"
    pasa, naive, bf16 = rows
    lo, hi = report["aggregate"]["pasa"]["psnr"]["ci95"]
    assert pasa[1] == f"43.44 [{lo:.2f}, {hi:.2f}]"
    assert pasa[-1] == "50% (single key)" and bf16[-1] == "0%"
    assert naive[1] == "n/a" and naive[-2] == "4 of 4 (8 frames)"
    _, pairs = paired_rows(report)
    assert [row[0] for row in pairs] == ["pasa \u2212 bf16"] and pairs[0][-1] == "pasa better"
    text = format_table(report)
    assert "Not shown, no sample where both have a finite PSNR: pasa \u2212 naive-half, naive-half \u2212 bf16." in text
    md = format_markdown(report, ["distributions.png"])
    assert "| pasa | 43.44 [" in md and "![rocket-seed1 pasa](videos/rocket-seed1_pasa.gif)" in md
    assert "LPIPS unavailable: no weights" in md and "![distributions](distributions.png)" in md


def test_the_16_bit_key_blocks_of_pasa_int8_are_summed_and_shown():
    """Records with pasa-int8's key-block counts (``fallbacks.int8_blocks``): summed over samples, shown beside
    the fallbacks and explained below the table; records without them (before they were counted) count 0."""
    records = make_records()
    counts = iter([(40, 1), (40, 3), (40, 0), (40, 0)])
    for r in records:
        if r["backend"] == "bf16":
            blocks, in_16_bits = next(counts)
            r["fallbacks"]["int8_blocks"] = {"blocks": blocks, "in_16_bits": in_16_bits}
    report = build_report(records, backends=BACKENDS, meta=META)
    assert report["health"]["bf16"]["fallbacks"]["int8_blocks"] == {"blocks": 160, "in_16_bits": 4, "share": 0.025}
    _, rows = table_rows(report)
    assert rows[2][-1] == "0%; 16-bit key blocks 2%" and rows[0][-1] == "50% (single key)"
    assert "16-bit key blocks: the share of pasa-int8's" in format_markdown(report, [])


def test_a_backend_that_always_fell_back_is_an_error():
    records = make_records()
    for r in records:
        if r["backend"] == "bf16":
            r["fallbacks"] = {"calls": 96, "fallback_calls": 96, "reasons": {"dtype": 96}}
    with pytest.raises(ValueError, match="'bf16' fell back on all 384 attention calls"):
        build_report(records, backends=BACKENDS, meta=META)


def test_report_needs_every_backend_on_every_sample():
    records = [r for r in make_records() if not (r["backend"] == "bf16" and r["seed"] == 1)]
    with pytest.raises(ValueError, match="'bf16' has records for 2 samples"):
        build_report(records, backends=BACKENDS, meta=META)


def test_write_report_writes_every_file_and_no_temporary_one(tmp_path):
    records = make_records()
    records[0]["psnr"] = "inf"  # an identical sample: drawn at a cap, shown as inf
    report = build_report(records, backends=BACKENDS, meta=META, video=video)
    written = write_report(report, records, tmp_path)
    assert list(written) == ["distributions", "psnr_per_frame", "markdown", "json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["distributions.png", "psnr_per_frame.png", "report.json",
                                                          "report.md"]
    loaded = json.loads((tmp_path / "report.json").read_text())
    assert loaded["aggregate"]["pasa"]["psnr"]["mean"] == "inf" and loaded["health"]["pasa"]["identical_samples"] == 1
    assert "inf (1 of 4 identical)" in (tmp_path / "report.md").read_text()
    for name in ("distributions", "psnr_per_frame"):
        assert written[name].read_bytes()[:8] == PNG_SIGNATURE
        assert iio.imread(written[name]).std() > 0


def test_write_report_replaces_the_old_report_only_once_the_new_one_is_complete(tmp_path, monkeypatch):
    records = make_records()
    write_report(build_report(records, backends=BACKENDS, meta=META), records, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    newer = build_report(records, backends=BACKENDS, meta={**META, "command": "pasa compare --newer"})

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report_module, "format_markdown", fail)  # after both plots were written
    with pytest.raises(RuntimeError, match="disk full"):
        write_report(newer, records, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before, "the old report is whole, no temporary file"
    monkeypatch.undo()
    write_report(newer, records, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["command"] == "pasa compare --newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)


# ------------------------------------------------------------------------------------------ the report in words


def set_psnr(records: list[dict], backend: str, values: list[float]) -> list[dict]:
    rows = [r for r in records if r["backend"] == backend]
    for r, value in zip(rows, values, strict=True):
        r["psnr"] = value
    return records


def pair_words(summary: dict, better: str, other: str) -> str:
    """The sentence the verdict must hold for a resolved pair, written from the paired summary."""
    mean, (lo, hi) = summary["mean"], summary["ci95"]
    if better != "pasa":
        mean, lo, hi = -mean, -hi, -lo
    return (f"{better} is {mean:.2f} dB (95 % CI {lo:.2f} to {hi:.2f}) closer to FP32 than {other} in PSNR, "
            f"over {summary['n']} samples.")


def test_a_one_sample_report_shows_and_promises_no_interval():
    """One sample has no bootstrap interval: the tables, their headings and the verdict say so (a 1-sample report
    said "mean [95% bootstrap interval]" over cells without one, and to read the intervals as a guide)."""
    one = [r for r in make_records() if (r["image"], r["seed"]) == SAMPLES[0]]
    report = build_report(one, backends=BACKENDS, meta=META)
    texts = format_table(report), format_markdown(report)
    for text in texts:
        assert "bootstrap interval]" not in text and "read the intervals" not in text and "[" not in "".join(
            line for line in text.splitlines() if line.startswith(("| pasa ", "pasa ")))
        assert "the one sample's value (no interval from one sample)" in text.lower()
    assert verdict(report)[-1] == ("With 1 sample there is no interval, so no difference is resolved; more images or "
                                   "seeds give one (about 10 make it firm).")
    two = build_report([r for r in make_records() if r["image"] == "builtin:rocket"], backends=BACKENDS, meta=META)
    assert "mean [95% bootstrap interval]" in format_table(two)
    assert "Mean over samples [95% bootstrap interval]" in format_markdown(two)


def test_the_verdict_follows_the_records():
    report = build_report(make_records(), backends=BACKENDS, meta=META)
    sentences = verdict(report)
    assert sentences[0] == ("naive-half gives non-finite (NaN or inf) frames in 4 of 4 samples (8 of 8 frames), "
                            "which no score counts; pasa and bf16 stay finite in every frame.")
    assert pair_words(report["paired"]["pasa - bf16"]["psnr"], "pasa", "bf16") in sentences
    assert sentences[-1].startswith("With 4 samples read the intervals as a rough guide")

    swapped = build_report(set_psnr(make_records(), "bf16", [50.0, 48.5, 49.0, 51.0]), backends=BACKENDS, meta=META)
    assert pair_words(swapped["paired"]["pasa - bf16"]["psnr"], "bf16", "pasa") in verdict(swapped)

    noise = build_report(set_psnr(make_records(), "bf16", [45.0, 40.5, 44.0, 44.25]), backends=BACKENDS, meta=META)
    summary = noise["paired"]["pasa - bf16"]["psnr"]
    lo, hi = summary["ci95"]
    assert lo < 0 < hi
    assert (f"pasa and bf16 cannot be told apart: pasa \u2212 bf16 is {summary['mean']:+.2f} dB of PSNR (95 % CI "
            f"\u2212{-lo:.2f} to +{hi:.2f}, which holds 0) over 4 samples.") in verdict(noise)

    finite = [r for r in make_records() if r["backend"] != "naive-half"]
    healthy = build_report(finite, backends=("pasa", "bf16"), meta=META)
    assert verdict(healthy)[0] == "every backend stays finite in every frame."


def test_the_report_explains_the_model_the_fallbacks_and_cpu_times():
    meta = {**META, "model_note": "a model with a note that the test wrote"}
    md = format_markdown(build_report(make_records(), backends=BACKENDS, meta=meta))
    opening = md.split("## Scores", 1)[0]
    assert opening.startswith("# pasa compare: tiny-resonant, 4 samples\n\nCompared: the attention backends pasa, "
                              "naive-half and bf16, each against FP32 attention (`fp32`, the reference), in the model "
                              "`tiny-resonant`, on 4 samples = 2 images x 2 seeds.")
    assert "The model: `tiny-resonant` is a model with a note that the test wrote." in opening
    assert "## Verdict" in opening and verdict(build_report(make_records(), backends=BACKENDS, meta=meta))[1] in opening
    assert "computed exactly another way, in documented cases only (a single key" in md
    assert "so 50 % is expected of the backends that run the PASA op" in md
    assert "| CPU time s |" in md and "CPU times say nothing about GPU speed" in md

    on_gpu = {**META, "settings": {**META["settings"], "device": "cuda"}}
    bf16_only = [r for r in make_records() if r["backend"] == "bf16"]
    md = format_markdown(build_report(bf16_only, backends=("bf16",), meta=on_gpu))
    assert "The model:" not in md and "| time s |" in md and "CPU times" not in md
    assert "50 % is expected" not in md, "no call fell back: nothing to explain"
    summary = build_report(bf16_only, backends=("bf16",), meta=on_gpu)["aggregate"]["bf16"]["psnr"]
    assert (f"bf16 has a PSNR of {summary['mean']:.2f} dB (95 % CI {summary['ci95'][0]:.2f} to "
            f"{summary['ci95'][1]:.2f}) against FP32 over 4 samples.") in md


def test_counts_are_in_the_singular_for_one():
    """"1 sample", not "1 samples", wherever a count is printed."""
    from pasa_diffusers.metrics.records import count

    assert (count(1, "sample"), count(2, "sample"), count(0, "result")) == ("1 sample", "2 samples", "0 results")
    report = build_report(make_records()[:len(BACKENDS)], backends=BACKENDS, meta=META)
    text = format_markdown(report) + format_table(report)
    assert report["samples"] == 1 and "1 sample" in text
    assert "1 samples" not in text
