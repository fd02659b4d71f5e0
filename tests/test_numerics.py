"""Input generators, error metrics and the study driver."""
import math

import pytest
import torch

from pasa_diffusers import numerics


def test_uniform_inputs_follow_the_paper():
    q, k, v = numerics.paper_inputs("uniform", 10.0, 5.0, (1, 4, 2, 300, 64), seed=3)
    assert q.shape == (1, 4, 300, 64) and k.shape == v.shape == (1, 2, 300, 64)
    assert q.dtype == torch.float16
    for t in (q, k, v):
        assert 5.0 <= t.min().item() and t.max().item() <= 15.0
        assert t.float().mean().item() == pytest.approx(10.0, abs=0.1)


def test_hybrid_inputs_have_rare_outliers():
    q, _, _ = numerics.paper_inputs("hybrid", 0.0, 100.0, (1, 8, 8, 1000, 64), seed=1, dtype=torch.float32)
    outliers = (q.abs() > 6).float().mean().item()
    assert 0.0003 < outliers < 0.002


def test_zero_mean_v_option():
    _, _, v = numerics.paper_inputs("uniform", 30.0, 0.5, (1, 2, 2, 500, 32), seed=2, v_mean=0.0)
    assert abs(v.float().mean().item()) < 0.05
    assert v.float().std().item() == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("phase, sign", [("in", 1), ("anti", -1)])
def test_resonance_aligns_token_means(phase, sign):
    q, k, _ = numerics.resonance_inputs((1, 2, 2, 400, 64), phase=phase, bias=10.0, seed=5, dtype=torch.float32)
    cos = torch.nn.functional.cosine_similarity(q.mean(2), k.mean(2), dim=-1)
    assert (sign * cos > 0.95).all()


def test_resonance_random_is_not_aligned():
    q, k, _ = numerics.resonance_inputs((1, 8, 8, 400, 64), phase="random", bias=10.0, seed=5, dtype=torch.float32)
    cos = torch.nn.functional.cosine_similarity(q.mean(2), k.mean(2), dim=-1)
    assert cos.abs().mean() < 0.5


def test_metrics():
    gold = torch.tensor([1.0, -1.0, 1.0, -1.0])
    out = gold + torch.tensor([0.1, -0.1, 0.1, -0.1])
    assert numerics.rmse(out, gold) == pytest.approx(0.1)
    assert numerics.rel_rmse(out, gold) == pytest.approx(0.1)
    assert numerics.rel_rmse_v(out, gold, 2 * gold) == pytest.approx(0.05)
    assert numerics.max_abs_error(out, gold) == pytest.approx(0.1)
    assert numerics.nonfinite_count(torch.tensor([1.0, math.inf, math.nan])) == 2


def test_study_marks_overflow_and_tables():
    rows = numerics.run_study(shape=(1, 2, 1, 130, 128), dists=["uniform"], means=[30.0], amplitudes=[0.5],
                              variants=["FA half", "PASA half"])
    by = {r.variant: r for r in rows}
    assert by["FA half"].nonfinite > 0 and math.isnan(by["FA half"].rel_rmse)
    assert by["PASA half"].nonfinite == 0 and by["PASA half"].rel_rmse < 1e-2
    assert by["PASA half"].max_abs_score > 65504
    table = numerics.study_table(rows)
    assert "NaN/inf" in table and "PASA half" in table


def test_bad_inputs():
    with pytest.raises(ValueError, match="dist"):
        numerics.paper_inputs("gauss", 0, 1, (1, 1, 1, 4, 16))
    with pytest.raises(ValueError, match="shape"):
        numerics.paper_inputs("uniform", 0, 1, (1, 1, 4, 16))
    with pytest.raises(ValueError, match="variants"):
        numerics.run_study(shape=(1, 1, 1, 4, 16), variants=["FA fp8"])
    with pytest.raises(ValueError, match="phase"):
        numerics.resonance_inputs(phase="sideways")


def test_stress_study_and_plot(tmp_path):
    rows = numerics.run_stress(["FA half", "exact hybrid"], shape=(1, 1, 1, 130, 64))
    by = {(r["case"], r["variant"]): r for r in rows}
    assert by[("resonance in", "FA half")]["nonfinite"] > 0
    assert by[("resonance in", "exact hybrid")]["rel_rmse"] < 1e-3
    assert by[("bf16 uniform(30,0.5)", "FA half")]["rel_rmse"] is None
    table = numerics.stress_table(rows)
    assert "NaN/inf" in table and "n/a" in table
    study = numerics.run_study(shape=(1, 1, 1, 64, 64), dists=["uniform"], means=[0.0, 30.0], amplitudes=[0.5],
                               variants=["FA half", "exact hybrid"])
    numerics.plot_error_vs_bias(study, tmp_path / "bias.png")
    assert (tmp_path / "bias.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_phase_of_pasa_numerics_shows_progress(tmp_path, monkeypatch, capsys):
    """``pasa numerics`` showed a bar over the grid only, then nothing for minutes (about 4.5 of a full run's)
    while the beta sweep and the stress cases ran: each phase now has its own bar, counting its runs (here on
    tiny shapes: 32 grid cells, 4 x 4 sweep runs, 6 stress cases x 8 variants)."""
    import functools
    import re

    from pasa_diffusers.cli import main

    monkeypatch.setattr(numerics, "QUICK_SHAPE", (1, 1, 1, 64, 64))
    monkeypatch.setattr(numerics, "run_stress", functools.partial(numerics.run_stress, shape=(1, 1, 1, 64, 64)))
    assert main(["numerics", "--quick", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    for desc, total, unit in (("numerics", 32, "cell"), ("beta sweep (PASA half)", 16, "run"),
                              ("stress cases", 6 * len(numerics.VARIANTS), "run")):
        assert re.search(rf"{re.escape(desc)}: 100%\|[^|]*\| {total}/{total} \[[^\]]*(?:{unit}/s|s/{unit})\]",
                         err), (desc, err)
