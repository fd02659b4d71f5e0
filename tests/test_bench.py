"""The benchmark suite on a CPU: every entry point imports and answers ``--help``, ``python -m bench.<name>``
runs from the repository root, and ``bench.attention`` measures the tiny shapes under Triton's
interpreter (``conftest.py`` builds the kernels for it on a host without CUDA) into a folder."""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import ab, attention, harness, sparse

ENTRY_POINTS = ("ab", "attention", "accuracy", "unet", "dit", "overhead", "temporal", "hopper", "cold_start",
                "video", "accumulation", "context_parallel", "int8_accuracy", "int8_fallback", "int8_spread", "sparse")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help(name, capsys):
    module = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m bench.{name}")
    assert "--out DIR" in out


def test_accuracy_takes_the_eight_bit_shapes(capsys):
    """``bench.accuracy --shapes eight-bit``: the 8-bit comparison's two shapes (one per head-dim tile, 4096 keys);
    an unknown set is refused by the parser."""
    from bench import accuracy

    assert [(s.d, s.nk, s.hq) for s in accuracy.SHAPE_SETS["eight-bit"]] == [(64, 4096, 4), (128, 4096, 4)]
    with pytest.raises(SystemExit) as stop:
        accuracy.main(["--shapes", "eight-bits"])
    assert stop.value.code == 2 and "invalid choice: 'eight-bits'" in capsys.readouterr().err


@pytest.mark.parametrize("name, flag, known", [
    ("ab", "--precisions", "('hybrid', 'half', 'int8', 'fp8')"), ("ab", "--inputs", "('normal', 'wide')"),
    ("int8_fallback", "--kernels", "('auto', 'gluon', 'portable')"),
    ("int8_fallback", "--inputs", "('benign', 'two biases per block')"),
    ("sparse", "--masks", "('random', 'radial', 'dense')"), ("sparse", "--methods", "('pasa', "),
])
def test_name_lists_are_refused_by_the_parser(name, flag, known, capsys):
    """Every comma-separated list of names takes ``harness.name_list``: an unknown or empty entry is the parser's
    one-line refusal naming the flag and what it takes; spaces around the names are dropped."""
    module = importlib.import_module(f"bench.{name}")
    for text in ("bogus", ","):
        with pytest.raises(SystemExit) as stop:
            module.main([flag, text])
        err = capsys.readouterr().err.splitlines()[-1]
        assert stop.value.code == 2 and f"argument {flag}: {text!r}: expected a comma-separated list of {known}" in err
    assert harness.name_list(("a", "b"))(" b, a ") == ["b", "a"]


def test_int8_fallback_gluon_configs_take_words(capsys):
    """``bench.int8_fallback --gluon-configs``: tile sizes, then any of the rescale's and the turns' words, each
    setting its config key; the rows are labelled by what the config names; an unknown word is refused."""
    from bench import int8_fallback

    config = int8_fallback._gluon_config("128,2,2,eager,pingpong")
    assert config == {"BLOCK_N": 128, "num_stages": 2, "consumers": 2, "lazy": False, "pingpong": True}
    assert int8_fallback._config_label(config) == "128,2,2 eager pingpong"
    assert int8_fallback._config_label(int8_fallback._gluon_config("64,3,3")) == "64,3,3"
    assert int8_fallback._config_label(int8_fallback._gluon_config("128,2,2,nopingpong")) == "128,2,2 nopingpong"
    with pytest.raises(SystemExit) as stop:
        int8_fallback.main(["--gluon-configs", "128,2,2,pingpang"])
    assert stop.value.code == 2 and "'128,2,2,pingpang': expected BLOCK_N,STAGES,CONSUMERS" in capsys.readouterr().err


def test_int8_fallback_rows_say_the_config_that_ran():
    """A ``--gluon-configs`` entry leaves out what the tuned config fills in (the turns are on at head dim 64, off
    at 128): the row's note names the config the kernel ran, every word."""
    from bench import int8_fallback

    config = int8_fallback._gluon_config("128,2,2")
    for d, turns in ((64, "pingpong"), (128, "nopingpong")):
        q = torch.empty(1, 2, 4096, d, device="meta")
        assert int8_fallback._ran_label(config, q, q) == f"128,2,2 eager {turns}"
    q = torch.empty(1, 2, 4096, 64, device="meta")
    no_turns = int8_fallback._gluon_config("128,2,2,nopingpong")
    assert int8_fallback._ran_label(no_turns, q, q) == "128,2,2 eager nopingpong"


def test_int8_fallback_one_launch_lifts_the_ranges_and_puts_them_back():
    """``bench.int8_fallback --one-launch`` times the 8-bit path with the router's ranges lifted: inside, a call the
    router splits at Wan 2.1's shape runs in one range; after, the share is the router's again."""
    from bench import int8_fallback
    from pasa_diffusers.kernels import dispatch, quantize

    q = torch.empty(2, 12, 32760, 128, dtype=torch.bfloat16, device="meta")
    written = quantize.written_bytes(q, q, q)
    share = dispatch.QUANTIZE_SHARE
    with int8_fallback._one_launch():
        assert len(dispatch.key_chunks(q, q, written, share=dispatch.QUANTIZE_SHARE)) == 1
    assert dispatch.QUANTIZE_SHARE == share and len(dispatch.key_chunks(q, q, written, share=share)) > 1


@pytest.mark.slow
def test_runs_as_module_from_the_root():
    run = subprocess.run([sys.executable, "-m", "bench.attention", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "--shapes" in run.stdout and "--methods" in run.stdout


def test_methods_are_checked():
    assert harness.parse_methods("sdpa,exact-hybrid,sdpa-math") == [
        "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "exact-hybrid"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown method 'exact-fp64'"):
        harness.parse_methods("sdpa,exact-fp64")


@pytest.mark.parametrize("warmup_ms, rep_ms, batch, calls", [(0, 0, 1, 1), (0, 0, 3, 3), (0, 1e9, 1, 1000),
                                                              (1e9, 0, 1, 1 + 1000 + 1)],
                         ids=["no-warm-up", "batched", "repetitions", "warm-up"])
def test_the_cpu_timer_times_its_estimating_run_when_no_warm_up_is_due(warmup_ms, rep_ms, batch, calls, monkeypatch):
    """On a CPU the run that estimates the counts is the first timed one unless a warm-up run is due: with
    neither warm-up nor repetitions asked, an interpreted kernel runs once per timing, not twice."""
    monkeypatch.setattr(harness.torch.cuda, "is_available", lambda: False)
    count = []
    timer = harness.Timer(warmup_ms=warmup_ms, rep_ms=rep_ms, batch=batch, max_runs=1000)
    assert timer(lambda: count.append(1)) >= 0
    assert len(count) == calls


def test_failures_are_rows(gen):
    shape = harness.Shape("test", "small", 1, 2, 2, 16, 16, 16)
    q, k, v = harness.make_inputs(shape, gen)

    def broken(q, k, v):
        raise RuntimeError("no kernel for this\nsecond line")

    def skipped(q, k, v):
        raise harness.Skip("not for these inputs")

    methods = [harness.sdpa_method("math"), harness.Method("broken", "peer", broken),
               harness.Method("skipped", "peer", skipped)]
    rows = harness.measure(shape, methods, q, k, v, timer=harness.Timer(warmup_ms=0, rep_ms=0))
    by_name = {r.method: r for r in rows}
    assert by_name["sdpa-math"].ms > 0 and by_name["sdpa-math"].vs_best_sdpa == 1.0
    assert by_name["broken"].ms is None and by_name["broken"].error == "RuntimeError: no kernel for this"
    assert by_name["skipped"].ms is None and by_name["skipped"].error == "skipped: not for these inputs"


def test_attention_needs_the_interpreter_on_a_cpu(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA host runs the kernels")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert attention.main(["--shapes", "tiny", "--out", str(tmp_path)]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_attention_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the op takes the interpreted kernel, not the reference
    assert attention.main(["--shapes", "tiny", "--out", str(tmp_path), "--warmup-ms", "0", "--rep-ms", "0"]) == 0
    md, report = (tmp_path / "attention.md").read_text(), json.loads((tmp_path / "attention.json").read_text())
    assert report["environment"]["torch"] == torch.__version__
    shapes = {s.label for s in harness.TINY}
    assert {r["shape"] for r in report["rows"]} == shapes
    for shape in shapes:
        rows = {r["method"]: r for r in report["rows"] if r["shape"] == shape}
        sdpa = [r for r in rows.values() if r["kind"] == "sdpa" and r["ms"] is not None]
        assert sdpa and all(math.isfinite(r["ms"]) and r["ms"] > 0 for r in sdpa)
        assert max(r["vs_best_sdpa"] for r in sdpa) == 1.0
        default = rows["exact-hybrid"]
        assert default["error"] == "" and default["finite"] is True
        assert math.isfinite(default["ms"]) and default["ms"] > 0
        assert default["note"].split()[0] in harness.kernel_names()
        assert f"| {shape} |" in md
        assert all(r["peak_mib"] is None for r in rows.values())  # a CPU has no GPU memory to measure
    assert "exact-hybrid" in md and "| peak MiB |" in md
    assert "![speed per method and shape](attention.png)" in md
    assert (tmp_path / "attention.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_sparse_tiny(tmp_path, monkeypatch):
    """The masked kernel skips blocks (the portable kernel named), its ratios are read against its own dense row
    and FlexAttention's at the same mask, and the dynamic mask's build is timed; the portable 8-bit kernel by name
    runs at both masks, and the GPU-only split of the time (graph ms, host us) is empty on a CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert sparse.main(["--shapes", "tiny", "--densities", "0.5", "--methods", "pasa,portable-fp8,flex,pooled",
                        "--out", str(tmp_path), "--warmup-ms", "0", "--rep-ms", "0"]) == 0
    rows = json.loads((tmp_path / "sparse.json").read_text())["rows"]
    portable = [r for r in rows if r["method"] == "portable-fp8"]
    assert [(r["mask"], r["note"], r["error"]) for r in portable] == [("dense", "portable-int8", ""),
                                                                      ("random 0.5", "portable-int8", "")]
    assert portable[1]["vs_own_dense"] == pytest.approx(portable[0]["ms"] / portable[1]["ms"])
    rows = [r for r in rows if r["method"] != "portable-fp8"]
    assert [(r["mask"], r["method"]) for r in rows] == [("dense", "pasa"), ("dense", "flex"), ("dense", "pooled"),
                                                        ("random 0.5", "pasa"), ("random 0.5", "flex")]
    assert all(r["error"] == "" and r["ms"] > 0 for r in rows)
    assert rows[0]["graph_ms"] is None and rows[0]["host_us"] is None
    masked = rows[3]
    assert masked["note"] == "portable" and masked["density"] == 0.5
    assert masked["vs_own_dense"] == pytest.approx(rows[0]["ms"] / masked["ms"])
    assert masked["vs_flex"] == pytest.approx(rows[4]["ms"] / masked["ms"])
    assert rows[2]["effective_tflops"] is None and "| random 0.5 | 0.500 | pasa |" in (tmp_path / "sparse.md").read_text()


@pytest.mark.slow
def test_ab_times_an_exported_copy_beside_this_checkout(tmp_path):
    """``bench.ab`` as its docstring runs it on a CPU: ``--export`` of this checkout's folder writes a renamed copy
    (its imports and its op's library name its own), and the run, after two processes have run every call once,
    times both on the same inputs: each tiny shape a row from the copy's files, equal bits (the same code), equal
    errors, a median per copy."""
    assert ab.main(["--export", str(ROOT), str(tmp_path / "base")]) == 0
    copy = tmp_path / "base" / "pasa_base"
    sources = "".join(p.read_text() for p in copy.rglob("*.py"))
    assert "pasa_diffusers" not in sources and '"pasa::' not in sources and '"pasa_base::attention"' in sources
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.ab", "--base", str(tmp_path / "base"), "--shapes", "tiny",
                           "--precisions", "int8", "--inputs", "normal", "--rounds", "1", "--warmup", "0",
                           "--compile-jobs", "2", "--out", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert report["base"] == str(copy / "__init__.py")
    assert [r["shape"] for r in report["rows"]] == [s.label for s in harness.TINY]
    for row in report["rows"]:
        assert row["same_bits"] is True and row["base_rmse"] == row["this_rmse"] < 2e-2
        assert row["base_ms"] > 0 and row["this_ms"] > 0 and row["ratio"] == row["this_ms"] / row["base_ms"]


def test_ab_says_what_is_missing_in_one_line(tmp_path, capsys, monkeypatch):
    """A ``--base`` folder without the copy, an ``--export`` over an existing copy or of an unknown revision, and a
    run without ``--base``: each one line naming what to do, exit status 2, nothing written."""
    (tmp_path / "base" / "pasa_base").mkdir(parents=True)
    assert ab.main(["--export", str(ROOT), str(tmp_path / "base")]) == 2
    assert "base/pasa_base exists; remove it or name another DIR" in capsys.readouterr().err
    assert ab.main(["--export", "no-such-revision", str(tmp_path / "other")]) == 2
    assert "rev='no-such-revision' is neither a folder holding pasa_diffusers/ nor a git revision" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit) as stop:
        ab.main(["--shapes", "tiny"])
    assert stop.value.code == 2 and "one of --base DIR (a run) or --export REV DIR is required" in (
        capsys.readouterr().err)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the CPU's check, to the folder's
    assert ab.main(["--base", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "empty holds no pasa_base/ package; make one with `python -m bench.ab" in err
    assert not (tmp_path / "other").exists() and not (tmp_path / "out").exists()


def test_dit_runs_a_tiny_transformer_per_backend(tmp_path):
    """``bench.dit`` on a tiny Wan on the CPU (SDPA and the op's CPU path, its reference): one row per
    backend, finite, with the routed processors' calls counted."""
    from bench import dit

    assert dit.main(["--model", "tiny-wan", "--backends", "sdpa", "fp32", "--iters", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "dit.json").read_text())["rows"]
    assert [r["backend"] for r in rows] == ["sdpa", "fp32"]
    assert all(r["finite"] and r["ms"] > 0 and r["first_call_s"] > 0 and r["fallback_calls"] == 0 for r in rows)
    assert rows[1]["rel_rms_diff"] == 0.0  # SDPA on fp32 copies in an fp32 model: the same arithmetic
    assert all(0.0 < r["attention_share"] < 1.0 for r in rows)
    text = (tmp_path / "dit.md").read_text()
    assert text.startswith("# bench.dit: one forward of tiny-wan") and "attention share" in text


@pytest.mark.slow
def test_dit_runs_a_sparse_backend_bound_to_the_tokens(tmp_path, monkeypatch):
    """A sparse backend's forward: its processors bound to the tiny Wan's 3 x 4 x 4 tokens (one block: every call
    sparse with a mask that keeps all), its summary in the row; a tiny model without a known grid is refused."""
    from bench import dit

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = ["--model", "tiny-wan", "--backends", "pasa", "pasa-sparse", "--dense-layers", "0", "--iters", "1",
            "--out", str(tmp_path)]
    assert dit.main(argv) == 0
    rows = json.loads((tmp_path / "dit.json").read_text())["rows"]
    sparse = rows[1]["sparse"]
    assert rows[0]["sparse"] is None and sparse["layers"] == 2 and sparse["density"] == 1.0
    assert sparse["sparse_calls"] > 0 and sparse["dense_calls"] == {}
    assert rows[1]["rel_rms_diff"] == 0.0  # a mask that keeps every block runs as no mask
    with pytest.raises(SystemExit):
        dit.main(["--model", "tiny-ltx-video", "--backends", "pasa-sparse", "--out", str(tmp_path)])


def test_full_size_self_attention_tokens():
    from pasa_diffusers.pipelines.video_dits import full_size_tokens

    assert full_size_tokens("wan2.1-1.3b", "720p").n_tokens == 21 * 45 * 80
    cog, hunyuan = full_size_tokens("cogvideox-5b"), full_size_tokens("hunyuan-video", "540p")
    assert (cog.frames, cog.height, cog.width, cog.text, cog.text_at) == (13, 30, 45, 226, "first")
    assert (hunyuan.n_video, hunyuan.text, hunyuan.text_at) == (67320, 256, "last")


def test_attention_share_is_the_time_inside_the_attention_calls(monkeypatch):
    """harness.attention_share on a tiny Wan whose attention calls each take 20 ms more, in a run that also
    sleeps 100 ms outside them: at least the calls' 20 ms each, at most what the 100 ms leave; the processors
    are as they were after it."""
    import time

    from bench import dit
    from pasa_diffusers import install
    from pasa_diffusers.processors import SDPAAttnProcessor

    model = dit.make_model("tiny-wan")
    inputs = dit.make_inputs("tiny-wan", model, "")
    install.apply(model, "sdpa")
    stock = SDPAAttnProcessor.attention

    def slow(self, *args, **kwargs):
        time.sleep(0.02)
        return stock(self, *args, **kwargs)

    monkeypatch.setattr(SDPAAttnProcessor, "attention", slow)
    calls = install.fallback_summary(model)["calls"]

    def run():
        time.sleep(0.1)
        return model(**inputs)

    t0 = time.perf_counter()
    share = harness.attention_share(model, run)
    wall_ms = (time.perf_counter() - t0) * 1e3
    calls = install.fallback_summary(model)["calls"] - calls
    assert calls > 0 and 20.0 * calls / wall_ms <= share <= 1.0 - 100.0 / wall_ms
    processors = {install.counted_processor(p) for p in install.attention_processors(model).values()}
    assert all("attend" not in vars(p) for p in processors)


def test_hopper_checks_big_shapes_on_fewer_heads():
    """bench.hopper's check draws keep the float64 golden of their checked batch entries within GOLDEN_BYTES
    (the DiTs' full shapes would need 192-226 GiB), and keep small shapes whole."""
    from bench import hopper

    for shape in [(2, 12, 32760, 128), (1, 24, 45000, 128), (2, 48, 17776, 64), (1, 40, 32760, 128)]:
        b, h, n, d = hopper.check_shape(shape)
        assert (b, n, d) == (shape[0], shape[2], shape[3]) and 1 <= h < shape[1]
        assert h == 1 or min(b, 2) * h * n * n * 8 <= hopper.GOLDEN_BYTES
    assert hopper.check_shape((50, 5, 9216, 64)) == (50, 5, 9216, 64)


def test_unet_table_has_a_line_per_row():
    """bench.unet's report table (the bench itself needs the full-size UNet on a GPU): a line per row, the
    attention share as a percentage, ``-`` for a compiled row."""
    from bench import unet

    row = {"frames": 14, "backend": "pasa", "mode": "eager", "first_call_s": 1.6, "ms": 344.43, "vs_first": 1.068,
           "attention_share": 0.284, "finite": True, "rel_rms_diff": 1.64e-3, "fallback_calls": 320}
    text = unet.table([row, {**row, "mode": "compile", "attention_share": None}], "sdpa")
    lines = text.splitlines()
    assert len(lines) == 4 and "vs sdpa" in lines[0] and "attention share" in lines[0]
    assert "| 344.4 |" in lines[2] and "| 28 % |" in lines[2] and "| - |" in lines[3]


@pytest.mark.slow
def test_dit_compiles_each_block_and_puts_the_originals_back(tmp_path, monkeypatch):
    """``bench.dit --compile`` on a tiny Wan: each backend's compiled row is regional (every
    ``WanTransformerBlock`` compiled with ``fullgraph=True``; dynamo's eager backend here, inductor would
    compile C++ on this CPU) and gives eager's output; ``compile_regions`` swaps the blocks and its undo puts
    the same modules back."""
    import functools

    from bench import dit

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    assert dit.main(["--model", "tiny-wan", "--backends", "sdpa", "fp32", "--compile", "--iters", "1",
                     "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "dit.json").read_text())["rows"]
    assert [(r["backend"], r["mode"]) for r in rows] == [("sdpa", "eager"), ("sdpa", "compile, regional"),
                                                         ("fp32", "eager"), ("fp32", "compile, regional")]
    assert all(r["finite"] and r["rel_rms_diff"] < 1e-5 for r in rows)
    assert [r["attention_share"] is None for r in rows] == [False, True, False, True]

    model = dit.make_model("tiny-wan")
    blocks = list(model.blocks)
    undo = harness.compile_regions(model, dit.repeated_blocks(model))
    assert all(type(b).__name__ == "OptimizedModule" for b in model.blocks)
    undo()
    assert all(a is b for a, b in zip(model.blocks, blocks, strict=True))
    with pytest.raises(ValueError, match="no submodule of the classes"):
        harness.compile_regions(model, ["NoSuchBlock"])
