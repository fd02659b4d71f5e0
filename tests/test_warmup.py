"""``pasa warmup`` and the commands' one-line notice when a first call compiles (``cli/warmup.py``).

On the CPU: the arguments and every refusal (one line, exit status 2: no CUDA device above all), the shapes run
through the op (Triton's interpreter), the fewest steps a pipeline takes, the notice said once and only for this
package's kernels Triton compiled, and the compile listener and cache count of ``compat`` on this Triton with a
kernel really compiled for sm_90 (no GPU needed).  On a GPU: a fresh cache's first ``pasa generate`` says once that
it compiles; after ``pasa warmup`` at the same flags it compiles nothing.
"""
from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pasa_diffusers import compat
from pasa_diffusers.cli import main
from pasa_diffusers.cli.warmup import CompileNotice, fewest_steps, parse_shape, warm_model, warm_shapes

ROOT = Path(__file__).resolve().parents[1]
NOTICE = "pasa: compiling attention kernels for this GPU"


def _error(capsys, argv: list[str]) -> str:
    """The one stderr line of ``pasa <argv>``, which must exit 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_help_names_what_it_compiles(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["warmup", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pasa warmup") and "Triton's own cache" in out
    for flag in ("--model", "--shapes", "--attention", "--dtype", "--frames", "--device"):
        assert flag in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_on_a_machine_without_cuda_it_refuses_in_one_line(capsys):
    """The refusal names --device only where it was given (was: "--device cuda: ..." for a flag not given)."""
    line = _error(capsys, ["warmup", "--shapes", "2,4,300,64"])
    assert line == (f"pasa warmup: error: no CUDA device on this machine (torch {torch.__version__}); warmup compiles "
                    "the kernels for the GPU it runs on, a CUDA device (--device cuda, the default, or cuda:N)")
    assert _error(capsys, ["warmup", "--model", "tiny"]).startswith("pasa warmup: error: no CUDA device on this ")
    assert _error(capsys, ["warmup", "--model", "tiny", "--device", "cuda:1"]) == (
        f"pasa warmup: error: --device cuda:1: no CUDA device on this machine (torch {torch.__version__}); warmup "
        "compiles the kernels for the GPU it runs on")


@pytest.mark.parametrize("argv, message", [
    ([], "give --model MODEL (a model's attention calls) or --shapes B,H,N,D ... (the op's), or both"),
    (["--shapes", "2,4,300,64", "--device", "cpu"], "--device cpu: warmup compiles the kernels for a CUDA GPU"),
    (["--shapes", "2,4,300"], "argument --shapes: expected B,H,N,D[,NK[,HK]] of positive integers"),
    (["--shapes", "2,4,0,64"], "argument --shapes: expected B,H,N,D[,NK[,HK]] of positive integers"),
    (["--shapes", "2,4,300,64,100,3"], "argument --shapes: 2,4,300,64,100,3: the key heads HK=3 must divide the "
                                        "query heads H=4"),
    (["--shapes", "2,4,300,64", "--dtype", "fp32"], "--dtype fp32: --shapes runs the kernels on fp16 or bf16"),
    (["--model", "tiny", "--attention", "sdpa"], "argument --attention: invalid choice: 'sdpa'"),
    (["--model", "tiny", "--device", "gpu"], "argument --device: expected cpu, cuda or cuda:N, got 'gpu'"),
    (["--model", "tiny", "--frames", "1"], "argument --frames: must be an integer >= 2"),
])
def test_bad_arguments_are_one_line_errors(capsys, argv, message):
    line = _error(capsys, ["warmup", *argv])
    assert line.startswith("pasa warmup: error: ") and message in line, line


def test_the_interpreter_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    line = _error(capsys, ["warmup", "--shapes", "2,4,300,64"])
    assert "TRITON_INTERPRET=1 is set: the kernels would run in Triton's interpreter and nothing would compile" in line


def test_shapes_parse_with_their_defaults():
    assert parse_shape("2,4,300,64") == (2, 4, 300, 64, 300, 4)
    assert parse_shape("2,4,300,64,77") == (2, 4, 300, 64, 77, 4)
    assert parse_shape("1,28,1407,128,1407,4") == (1, 28, 1407, 128, 1407, 4)
    with pytest.raises(argparse.ArgumentTypeError, match="B,H,N,D"):
        parse_shape("2,4,x,64")


class _Bar:
    def __init__(self) -> None:
        self.done, self.said = 0, []

    def set_description(self, text: str) -> None:
        self.said.append(text)

    def update(self, n: int) -> None:
        self.done += n


def test_the_shapes_run_through_the_op(monkeypatch):
    """Each shape runs the op once, as the processors call it (under the interpreter here: no compile); a
    shape the op refuses is a usage error naming it."""
    from pasa_diffusers.kernels.common import INTERPRET

    if not INTERPRET:
        pytest.skip("needs the kernels built for Triton's interpreter (a host without CUDA)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bar = _Bar()
    warm_shapes([(1, 2, 40, 32, 40, 2), (2, 4, 20, 16, 30, 2)], "pasa", "bf16", "cpu", bar)
    assert bar.done == 2 and bar.said == ["warmup 1,2,40,32", "warmup 2,4,20,16,30,2"]
    from pasa_diffusers.cli.common import UsageError

    with pytest.raises(UsageError, match=r"--shapes 1,2,40,8: pasa_attention: .*head dim"):
        warm_shapes([(1, 2, 40, 8, 40, 2)], "pasa", None, "cpu", _Bar())


@pytest.mark.parametrize("model, steps", [("tiny", 1), ("tiny-ltx-video", 2)])
def test_a_model_runs_the_fewest_steps_its_pipeline_takes(model, steps):
    from pasa_diffusers.cli import build_parser
    from pasa_diffusers.cli.common import generation_settings
    from pasa_diffusers.pipelines.video import load_pipeline

    args = build_parser().parse_args(["warmup", "--model", model])
    pipe = load_pipeline(model, device="cpu", dtype=torch.float32)
    settings = fewest_steps(args, pipe)
    assert settings["num_inference_steps"] == steps
    generate = generation_settings(build_parser().parse_args(["generate", "--model", model]), pipe)
    sizes = ("num_frames", "height", "width")
    assert {k: settings[k] for k in sizes} == {k: generate[k] for k in sizes}  # pasa generate's defaults


def test_a_model_runs_one_short_generation_through_the_backend(monkeypatch):
    """``warm_model`` on the tiny SVD (on the CPU: the op's PyTorch reference, nothing to compile): loaded, the
    backend installed, one step at pasa generate's size, its attention calls through the backend's processors."""
    from pasa_diffusers import install
    from pasa_diffusers.cli import build_parser

    installed = []

    def apply(pipe, backend, *rest, **options):
        installed.append(pipe)
        return real_apply(pipe, backend, *rest, **options)

    real_apply = install.apply
    monkeypatch.setattr(install, "apply", apply)
    args = build_parser().parse_args(["warmup", "--model", "tiny", "--attention", "pasa-half", "--device", "cpu"])
    bar = _Bar()
    assert warm_model(args, bar) == "tiny at 4 frames 64x64 (1 step(s))"
    assert bar.done == 2 and bar.said == ["warmup tiny: loading", "warmup tiny: 1 step(s)"]
    summary = install.fallback_summary(installed[0])
    assert summary["backends"] == ["pasa-half"] and summary["calls"] > summary["fallback_calls"], summary
    assert set(summary["fallbacks"]) <= {"single key"}, summary  # SVD's cross-attention to its one image token


def test_the_notice_is_one_line_at_the_first_kernel_of_ours_compiled():
    stream = io.StringIO()
    notice = CompileNotice(stream)
    notice("pasa_diffusers.kernels.portable", "attn_fwd_kernel", True)  # loaded from the cache: nothing to say
    notice("torch._inductor.generated", "triton_poi_fused", False)  # not ours
    assert stream.getvalue() == ""
    notice("pasa_diffusers.kernels.hopper", "exact_fwd_gluon_kernel", False)
    notice("pasa_diffusers.kernels.packed", "packed_fwd_kernel", False)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith(NOTICE)
    assert "exact_fwd_gluon_kernel" in lines[0] and "`pasa warmup` compiles them ahead" in lines[0]


@pytest.mark.slow
def test_the_compile_listener_and_cache_count_on_this_triton(tmp_path):
    """A toy kernel compiled for sm_90 (no GPU: Triton's ptxas) in a fresh process and cache: the listener hears
    one compile then one cache hit, each with the kernel's module and name; the cache then holds one kernel."""
    (tmp_path / "toy_kernels.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl


        @triton.jit
        def double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)
    """))
    child = textwrap.dedent("""
        import json
        from pasa_diffusers import compat
        import toy_kernels

        heard = []
        remove = compat.add_compile_listener(lambda module, kernel, hit: heard.append([module, kernel, hit]))
        signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
        for _ in range(2):
            compat.compile_for_cuda(toy_kernels.double, signature, {"BLOCK": 128}, {}, {"num_warps": 4})
        remove()
        print(json.dumps(heard))
    """)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_MANAGER")}
    env.update(TRITON_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    run = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == '[["toy_kernels", "double", false], ["toy_kernels", "double", true]]'
    assert compat.cached_kernels(cache) == 1
    assert compat.cached_kernels(tmp_path / "nowhere") == 0


def test_the_cold_start_bench_runs_commands_that_parse(tmp_path):
    """``bench.cold_start``'s processes (the first video without and with ``pasa warmup``) are ``pasa`` commands
    the real parser takes, the warmup with the video's model and size flags, the timed video three times alike."""
    from bench import cold_start

    from pasa_diffusers.cli import build_parser

    args = argparse.Namespace(model="svd-xt-random", frames=25, height=576, width=1024, steps=25, attention="pasa",
                              baseline="sdpa", formats="png")
    rows = cold_start.processes(args, tmp_path)
    assert [cache for _, cache, _ in rows] == ["baseline", "a", "a", "b", "b"]
    parsed = [build_parser().parse_args(argv) for _, _, argv in rows]
    assert [a.command for a in parsed] == ["generate", "generate", "generate", "warmup", "generate"]
    assert rows[1][2] == rows[2][2] == rows[4][2] and parsed[0].attention == "sdpa"
    for a in parsed:
        assert (a.model, a.frames, a.height, a.width, a.attention in ("pasa", "sdpa")) == ("svd-xt-random", 25, 576,
                                                                                           1024, True)
    assert all(a.formats == ("png",) for a in parsed if a.command == "generate")
    assert len(cold_start.processes(argparse.Namespace(**{**vars(args), "baseline": "none"}), tmp_path)) == 4


# ---- on a GPU -------------------------------------------------------------------------------------------------

def _pasa(argv: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_MANAGER")}
    env["TRITON_CACHE_DIR"] = str(cache)
    run = subprocess.run([sys.executable, "-m", "pasa_diffusers", *argv], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _compiled(run: subprocess.CompletedProcess) -> tuple[int, int]:
    found = re.search(r": (\d+) kernel\(s\) compiled, (\d+) already in ", run.stdout)
    assert found, run.stdout
    return int(found[1]), int(found[2])


@pytest.mark.gpu
def test_gpu_after_warmup_the_first_video_compiles_nothing(tmp_path):
    """In a fresh Triton cache the first ``pasa generate`` says once that it compiles; in another fresh cache,
    after ``pasa warmup`` at the same flags, ``pasa generate`` compiles nothing (no notice) and a second warmup
    finds every kernel in the cache.  ``--shapes`` alike: its second run compiles nothing."""
    flags = ["--model", "tiny", "--frames", "4", "--height", "64", "--width", "64"]
    video = ["generate", *flags, "--device", "cuda", "--formats", "png"]  # the GPU machine has no mp4 encoder
    cold = _pasa([*video, "--out", str(tmp_path / "cold")], tmp_path / "a")
    assert cold.stderr.count(NOTICE) == 1, cold.stderr

    warm = tmp_path / "b"
    compiled, _ = _compiled(_pasa(["warmup", *flags], warm))
    assert compiled > 0 and compat.cached_kernels(warm) >= compiled
    after = _pasa([*video, "--out", str(tmp_path / "after")], warm)
    assert NOTICE not in after.stderr, after.stderr
    again = _compiled(_pasa(["warmup", *flags], warm))
    assert again[0] == 0 and again[1] > 0

    shapes = ["--shapes", "2,4,1000,64", "28,2,25,64", "--dtype", "bf16"]
    first = _compiled(_pasa(["warmup", *shapes], warm))
    second = _compiled(_pasa(["warmup", *shapes], warm))
    assert first[0] > 0 and second[0] == 0 and second[1] > 0
