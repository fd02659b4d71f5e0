"""The `pasa` command line end to end on the tiny models (small sizes: a few seconds each), and the shared
argument helpers of ``pasa_diffusers.cli.common``.  The error probes through the console script are in
``test_errors.py``; ``pasa compare`` has its own tests."""
import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from tests.console import PASA
import torch

from pasa_diffusers import backends
from pasa_diffusers.cli import common, main
from pasa_diffusers.pipelines.names import BUILTIN_MODELS

SMALL = ["--frames", "2", "--steps", "2", "--height", "32", "--width", "32"]


def test_version_says_what_a_bug_report_needs(capsys):
    """``pasa --version`` (was: "unrecognized arguments"): the package, then Python, torch with its CUDA build and the
    GPU it sees, diffusers, transformers and triton, each as installed."""
    import importlib.metadata
    import platform

    import diffusers

    assert main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"pasa-diffusers {importlib.metadata.version('pasa-diffusers')}"
    assert lines[1].startswith(f"python {platform.python_version()}, torch {torch.__version__} (")
    assert f"), diffusers {diffusers.__version__}, " in lines[1] and len(lines) == 2
    gpu = f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no CUDA device"
    assert f", {gpu}), " in lines[1]


def test_generate_prints_a_few_lines_and_writes_its_summary_beside_the_video(tmp_path, capsys):
    """stdout is what a user reads: the attention in one line, whether the frames are finite, the files written; the
    processors' summary goes to OUT/BACKEND.json (was: a 25-line JSON on stdout on every run)."""
    assert main(["generate", *SMALL, "--model", "tiny-resonant", "--attention", "naive-half",
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    summary = json.loads((tmp_path / "naive-half.json").read_text())
    assert printed == [
        "attention: naive-half in 24 layers (NaiveHalfAttnProcessor, in float16); 48 calls, 24 of them by a documented "
        "fallback (single key: 24)",
        "NON-FINITE frames: 2 (first index 0)",
        f"wrote mp4: {tmp_path / 'naive-half.mp4'}",
        f"wrote gif: {tmp_path / 'naive-half.gif'}",
        f"wrote png: {tmp_path / 'naive-half'}",
        f"wrote summary: {tmp_path / 'naive-half.json'}",
    ]
    assert summary["attention_dtype"] == "float16"  # an fp32 model: naive-half runs on fp16 casts, and says so
    assert summary["fallbacks"] == {"single key": 24} and summary["calls"] == 48 and summary["nonfinite_frames"] == 2
    assert summary["backend"] == "naive-half" and sum(summary["installed"].values()) == 24
    assert summary["processors"]["spatial-self"] == "NaiveHalfAttnProcessor"
    assert summary["settings"] == {"num_frames": 2, "num_inference_steps": 2, "height": 32, "width": 32, "seed": 0}


@pytest.mark.slow
def test_generate_in_bf16_runs_pasa_in_bf16_not_by_fallback(tmp_path, capsys):
    """In a bf16 model every "pasa" call runs the op in bf16: none falls back to SDPA but the single keys."""
    assert main(["generate", *SMALL, "--dtype", "bf16", "--attention", "pasa", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "pasa.json").read_text())
    assert summary["attention_dtype"] == "bfloat16"
    assert summary["fallbacks"] == {"single key": summary["calls"] // 2}  # the cross-attentions only


def test_generate_writes_the_formats_asked_and_refuses_mp4_without_its_encoder_before_any_work(tmp_path, capsys,
                                                                                              monkeypatch):
    assert main(["generate", *SMALL, "--formats", "png,gif", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pasa", "pasa.gif", "pasa.json"]
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "imageio_ffmpeg" else object())
    assert main(["generate", *SMALL, "--model", "no/such-model", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "--formats mp4,gif,png: writing mp4 needs the imageio-ffmpeg package" in err and "--model" not in err


@pytest.mark.slow
def test_diagnose_names_the_planted_layers(tmp_path):
    assert main(["diagnose", *SMALL, "--model", "tiny-resonant", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "diagnosis.json").read_text())
    assert result["model"] == "tiny-resonant"
    assert sum(layer["overflows"] for layer in result["layers"]) == 3


def test_a_usage_error_is_one_line_and_status_2(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["generate", "--out", str(tmp_path / "afile")]) == 2
    out, err = capsys.readouterr()
    afile = tmp_path / "afile"
    assert out == "" and err == f"pasa generate: error: --out {afile}: {afile} is a file, not a folder\n"


@pytest.mark.parametrize("argv, listing", [
    (["generate", "--attention", "bogus"], f"(choose from {', '.join(map(repr, backends.BACKENDS))})"),
    (["compare", "--backends", "pasa,bogus"],
     f"choose from {', '.join(backends.COMPARED)} ({backends.REFERENCE} is always the reference)"),
])
def test_an_unknown_backend_is_refused_naming_the_registry(argv, listing, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "'bogus'" in err or "backend(s) bogus;" in err
    assert err.rstrip("\n").endswith(listing)


def test_help_lists_every_backend_with_its_summary(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also at hyphens
    for name, backend in backends.BACKENDS.items():
        assert "".join(f"{name}: {backend.summary}".split()) in text


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from pasa_diffusers.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_command_has_a_description_and_shows_its_defaults(command):
    parser = _subparsers()[command]
    assert parser.description and len(parser.description) > 60, command
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS, []):  # [] : none given
            shown = f"{action.default:g}" if isinstance(action.default, float) else str(action.default)
            assert "default" in (action.help or ""), f"{command} {action.option_strings[0]} hides its default"
            assert shown in action.help, f"{command} {action.option_strings[0]}: default {shown!r} not in its help"


@pytest.mark.parametrize("value, warns", [("1", True), ("true", True), ("ON", True), ("yes", True), ("y", True),
                                          ("0", False), ("", False), ("false", False), ("no", False), (None, False)])
def test_interpreter_warning_follows_tritons_reading_of_the_variable(value, warns, monkeypatch):
    from pasa_diffusers import ops
    from pasa_diffusers.cli import interpreter_warning

    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    warning = interpreter_warning()
    assert (warning is not None) == warns
    assert ops._interpreting() == warns  # the op takes the interpreted kernels exactly when the warning says so
    if warns:
        assert warning.startswith(f"pasa: warning: TRITON_INTERPRET={value} is set: ") and "\n" not in warning


def test_env_flags_read_as_triton_reads_its_own(monkeypatch):
    """``env.flag`` agrees with Triton's ``getenv_bool`` (which decides whether Triton interprets) on every value
    it takes, in several cases; a value it does not take is refused, where Triton would read it as off."""
    from pasa_diffusers import env

    libtriton = pytest.importorskip("triton._C.libtriton")
    if not hasattr(libtriton, "getenv_bool"):
        pytest.skip("this Triton reads TRITON_INTERPRET in Python (== '1')")
    for value in [*env.ON, *env.OFF, *(v.upper() for v in env.ON + env.OFF), "True", "Off"]:
        monkeypatch.setenv("PASA_TEST_FLAG", value)
        assert env.flag("PASA_TEST_FLAG") == libtriton.getenv_bool("PASA_TEST_FLAG", False), value
    for value in ["2", "enabled", " 1", "-1"]:
        monkeypatch.setenv("PASA_TEST_FLAG", value)
        assert libtriton.getenv_bool("PASA_TEST_FLAG", False) is False
        with pytest.raises(env.EnvFlagError, match=f"^environment variable PASA_TEST_FLAG={value!r}: expected one "
                                                     "of 1, true, yes, on, y \\(on\\) or 0, false, no, off, n, '' "
                                                     "\\(off\\)$"):
            env.flag("PASA_TEST_FLAG")
    monkeypatch.delenv("PASA_TEST_FLAG")
    assert env.flag("PASA_TEST_FLAG") is False and env.flag("PASA_TEST_FLAG", default=True) is True


def test_python_dash_m_runs_the_command_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pasa_diffusers", "generate", "--frames", "1"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "pasa generate: error: argument --frames: must be an integer >= 2 (SVD needs two frames), " \
                          "got 1\n"


@pytest.mark.parametrize("model", ["tny", "tiny/", "/tiny", "org/name/extra", "./org/name", "~/org"])
def test_check_model_refuses_what_load_svd_refuses(model, tmp_path, monkeypatch):
    from pasa_diffusers.pipelines.svd import ModelLoadError, load_svd

    monkeypatch.chdir(tmp_path)
    with pytest.raises(common.UsageError, match=f"^--model {re.escape(model)}: no such folder, and not a hub id"):
        common.check_model(model)
    with pytest.raises(ModelLoadError, match="no such folder .*, and not a hub id 'org/name' nor a built-in model"):
        load_svd(model, local_files_only=True)


@pytest.mark.parametrize("model", [*BUILTIN_MODELS, "org/name"])
def test_check_model_accepts_the_built_in_models_and_hub_ids(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert common.check_model(model) is None


def test_save_model_writes_a_folder_that_model_loads(tmp_path, capsys):
    from pasa_diffusers.pipelines.svd import load_svd

    folder = tmp_path / "saved"
    assert main(["save-model", "--model", "tiny", str(folder)]) == 0
    assert capsys.readouterr().out.startswith("saved tiny (")
    assert {p.suffix for p in folder.rglob("*.safetensors")} == {".safetensors"}
    assert not [p for p in folder.rglob("*") if p.suffix in (".bin", ".pt", ".pth")]
    loaded, built = load_svd(str(folder), local_files_only=True), load_svd("tiny")
    for name in ("unet", "vae", "image_encoder"):
        want = getattr(built, name).state_dict()
        got = getattr(loaded, name).state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert main(["generate", "--model", str(folder), "--frames", "2", "--steps", "1", "--height", "16",
                 "--width", "16", "--attention", "sdpa", "--out", str(tmp_path / "video")]) == 0


@pytest.mark.slow
def test_a_saved_planted_model_keeps_its_overflow(tmp_path):
    """tiny-resonant saved by the console script and diagnosed from the folder: the same 3 of 24 layers
    overflow as in the built-in model (they were 0 of 24 when from_pretrained dropped the planted biases)."""
    pasa = PASA
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    folder = tmp_path / "resonant"
    saved = subprocess.run([pasa, "save-model", "--model", "tiny-resonant", str(folder)], capture_output=True,
                           text=True, timeout=300, env=env)
    assert saved.returncode == 0, saved.stderr
    diagnosed = subprocess.run([pasa, "diagnose", "--model", str(folder), *SMALL, "--steps", "1",
                                "--out", str(tmp_path / "diag")], capture_output=True, text=True, timeout=300, env=env)
    assert diagnosed.returncode == 0, diagnosed.stderr
    assert f"{folder}: 3 of 24 attention layers overflow FP16" in diagnosed.stdout
    result = json.loads((tmp_path / "diag" / "diagnosis.json").read_text())
    from pasa_diffusers.pipelines.resonant import PLANTED_LAYERS

    assert {layer["path"] for layer in result["layers"] if layer["overflows"]} == set(PLANTED_LAYERS)


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny", "{folder}"], "DIR {folder}: the folder is not empty; pass a new or empty folder"),
    (["{new}"], "the following arguments are required: --model"),
])
def test_save_model_refusals(args, message, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    new = tmp_path / "new"
    argv = [a.format(folder=tmp_path, new=new) for a in args]
    assert main(["save-model", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"pasa save-model: error: {message.format(folder=tmp_path)}")
    assert not new.exists()


def test_ssim_min_size_is_the_metric_window_rounded_up_to_8():
    from pasa_diffusers.metrics.quality import SSIM_MIN_SIZE

    assert common.SCORED_MIN_SIZE == -(-SSIM_MIN_SIZE // common.SIZE_MULTIPLE) * common.SIZE_MULTIPLE == 16


@pytest.mark.parametrize("text, value", [("16", 16), ("64", 64)])
def test_int_range_accepts(text, value):
    assert common.int_range(16, 64, multiple_of=8)(text) == value


@pytest.mark.parametrize("text, message", [
    ("8", "must be a multiple of 8 in [16, 64] (why), got 8"),
    ("72", "must be a multiple of 8 in [16, 64] (why), got 72"),
    ("20", "must be a multiple of 8 in [16, 64] (why), got 20"),
    ("1.5", "expected an integer, got '1.5'"),
])
def test_int_range_refuses(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(message)}$"):
        common.int_range(16, 64, multiple_of=8, why="why")(text)


@pytest.mark.parametrize("text", ["0", "-1", "inf", "nan", "x"])
def test_fps_argument_refuses(text):
    from pasa_diffusers.metrics.limits import fps_argument

    with pytest.raises(argparse.ArgumentTypeError, match="number > 0"):
        fps_argument(text)


def test_check_out_dir_creates_the_folder(tmp_path):
    out = common.check_out_dir(tmp_path / "a" / "b")
    assert out.is_dir() and list(out.iterdir()) == []  # the probe file is gone


@pytest.mark.parametrize("model, sizes, keys", [
    ("tiny-ltx-video", [], 128),  # 48 video tokens, 128 text tokens in the cross-attention
    ("tiny-ltx-video", ["--height", "192", "--width", "224"], 128),  # 3 x 6 x 7 = 126 video tokens
    ("tiny-cogvideox", [], 55),  # 48 video + 7 text tokens in one joint attention
])
def test_an_8_bit_backend_of_one_key_block_is_refused_before_any_step(model, sizes, keys, tmp_path, capsys):
    """Every call of these runs has at most one key block (128 keys): pasa-int8 would compute all in 16 bits
    (its fallback) and was refused only after the whole video; now before the first step, nothing written."""
    out = tmp_path / "out"
    assert main(["generate", "--model", model, *sizes, "--attention", "pasa-int8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"pasa generate: error: --attention pasa-int8: every attention call of ") and (
        f"takes at most {keys} keys, one key block of 128, which pasa-int8 computes in 16 bits (its documented "
        "fallback): no call would run in 8 bits; generate a larger video (more than 128 tokens) or choose another "
        "backend") in err
    assert list(out.iterdir()) == []


@pytest.mark.slow
def test_an_8_bit_backend_runs_from_one_key_past_a_block(tmp_path, capsys):
    """The bound is exact: 3 x 7 x 7 = 147 video tokens (two key blocks) run in 8 bits in the self-attentions, while
    the cross-attentions to 128 text tokens fall back, as counted."""
    assert main(["generate", "--model", "tiny-ltx-video", "--height", "224", "--width", "224", "--steps", "2",
                 "--attention", "pasa-int8", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "pasa-int8.json").read_text())
    assert summary["fallbacks"] == {"one key block": summary["calls"] // 2}
