"""The tuned tables (``kernels/tuning.py``) through Triton's interpreter on the tiny shapes: a table written
by ``tools.tune_table`` is loaded and used (the kernels run its configs with no benchmark, the same bits
as the autotuned run that picked them), a key missing from it autotunes, an entry the pool or the prune
rejects warns once and is ignored, ``PASA_TUNED=0`` turns the tables off; the same mechanism on a toy
kernel (which Triton 3.6's interpreter runs too: ``-k mechanism``); the GPU names; the package data.

``conftest.py`` builds the kernels for the interpreter on a host without CUDA; on a CUDA host this
module skips unless ``TRITON_INTERPRET=1`` was set before pytest started.
"""
from __future__ import annotations

import json
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from bench import harness  # noqa: E402
from tools import tune_table  # noqa: E402
from pasa_diffusers import pasa_attention  # noqa: E402
from pasa_diffusers.kernels import dispatch, tuning  # noqa: E402,F401  (dispatch: every autotuner)
from pasa_diffusers.kernels.common import INTERPRET  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="kernels built for the GPU; set TRITON_INTERPRET=1 "
                                                      "before pytest to run these tests on the CPU")

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {s.name: s for s in harness.TINY}
"""The tiny shapes by name: spatial (the portable kernel on pre-centred keys: ``portable.tiled``),
temporal (``packed``), gqa (centred in the loop: ``portable.shift``)."""
KERNEL_OF = {"spatial": "portable.tiled", "temporal": "packed", "gqa": "portable.shift"}
TABLE = f"{tuning.INTERPRETER_TABLE}.json"


def _inputs(name: str, seed: int = 1) -> tuple[torch.Tensor, ...]:
    return harness.make_inputs(SHAPES[name], torch.Generator().manual_seed(seed))


def _launch(name: str) -> torch.Tensor:
    """The op's default on a tiny shape, the kernels autotuned under the interpreter."""
    with tuning.interpreter_autotuning():
        return pasa_attention(*_inputs(name))


def _bench_calls() -> int:
    return sum(t.bench_calls for t in tuning.autotuners().values())


def _only_key(kernel: str) -> tuple:
    tuner = tuning.autotuners()[kernel]
    assert len(tuner.choices) == 1, tuner.choices
    return next(iter(tuner.choices))


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """``tools.tune_table`` on the tiny shapes (exact-hybrid) into a folder; then, still with its picks
    cached, each tiny shape's output of the autotuned kernels.  Returns the folder, the picks
    (kernel -> key -> config) and the outputs."""
    out = tmp_path_factory.mktemp("tune")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv(tuning.ENV, raising=False)
        assert tune_table.main(["--shapes", "tiny", "--methods", "exact-hybrid", "--out", str(out)]) == 0
        picks = {name: dict(t.choices) for name, t in tuning.autotuners().items()}
        before = _bench_calls()
        outputs = {name: _launch(name) for name in SHAPES}
        assert _bench_calls() == before  # the picks were cached: the autotuned run of the picked configs
    tuning.forget()
    return out, picks, outputs


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Each test: kernels (not the reference) for CPU tensors, no choice remembered, no table set."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(tuning.ENV, raising=False)
    tuning.forget()
    yield
    tuning.forget()


def _write(path: Path, table: dict) -> Path:
    path.write_text(json.dumps(table))
    return path


@pytest.mark.slow
def test_table_is_written_with_every_kernel_picked(tuned):
    out, picks, _ = tuned
    table = tuning.load_table(out / TABLE)
    assert table["gpu"] == tuning.INTERPRETER_TABLE and table["triton"] == triton.__version__
    assert table["source"]["command"].startswith("python -m tools.tune_table --shapes tiny")
    assert (out / "tune_table.md").is_file() and (out / "tune_table.json").is_file()
    by_kernel = {e["kernel"]: e for e in table["entries"]}
    assert sorted(by_kernel) == sorted(KERNEL_OF.values())
    for name, kernel in KERNEL_OF.items():
        entry = by_kernel[kernel]
        (key, cfg), = picks[kernel].items()
        assert tuning.config_of(entry["config"]) == cfg
        assert tuple([*entry["key"].values(), *entry["dtypes"]]) == key
        assert len(entry["timings_ms"]) >= 2 and entry["ms"] == min(entry["timings_ms"].values())
        assert any(s.startswith(f"tiny {name} ") for s in entry["shapes"])


@pytest.mark.slow
def test_table_is_used_without_benchmarking_and_gives_the_same_bits(tuned, monkeypatch):
    out, picks, outputs = tuned
    monkeypatch.setenv(tuning.ENV, str(out / TABLE))
    for name, kernel in KERNEL_OF.items():
        got = _launch(name)
        tuner = tuning.autotuners()[kernel]
        key = _only_key(kernel)
        assert tuner.sources[key] == "table"
        assert tuner.choices[key] == picks[kernel][key]
        assert torch.equal(got, outputs[name]), name
    assert _bench_calls() == 0


@pytest.mark.slow
def test_a_folder_setting_and_the_shipped_folder_find_the_gpus_table(tuned, monkeypatch):
    out, _, _ = tuned
    monkeypatch.setenv(tuning.ENV, str(out))
    _launch("temporal")
    assert tuning.autotuners()["packed"].sources[_only_key("packed")] == "table"
    tuning.forget()
    monkeypatch.delenv(tuning.ENV)
    monkeypatch.setattr(tuning, "TABLE_DIR", out)  # as if the table were shipped for this device
    _launch("temporal")
    assert tuning.autotuners()["packed"].sources[_only_key("packed")] == "table"
    assert _bench_calls() == 0


@pytest.mark.slow
def test_pasa_tuned_0_turns_the_tables_off(tuned, monkeypatch):
    out, _, _ = tuned
    monkeypatch.setattr(tuning, "TABLE_DIR", out)
    monkeypatch.setenv(tuning.ENV, "0")
    _launch("temporal")
    packed = tuning.autotuners()["packed"]
    assert packed.sources[_only_key("packed")] == "benchmarked"
    assert packed.bench_calls == 4  # every config the prune keeps (1 warp, 1 or 2 sequences, CENTRE_IN_G)


@pytest.mark.slow
def test_a_key_missing_from_the_table_autotunes(tuned, monkeypatch, tmp_path):
    out, picks, _ = tuned
    table = tuning.load_table(out / TABLE)
    table["entries"] = [e for e in table["entries"] if e["kernel"] != "packed"]
    monkeypatch.setenv(tuning.ENV, str(_write(tmp_path / TABLE, table)))
    _launch("temporal")
    _launch("gqa")
    packed, shift = tuning.autotuners()["packed"], tuning.autotuners()["portable.shift"]
    assert packed.sources[_only_key("packed")] == "benchmarked" and packed.bench_calls == 4
    assert shift.sources[_only_key("portable.shift")] == "table" and shift.bench_calls == 0


@pytest.mark.slow
def test_the_key_is_the_autotuners_own(tuned):
    """The key the table is looked up by is the one Triton's autotuner caches its choice under."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tuning.ENV, "0")
        _launch("gqa")
    tuner = tuning.autotuners()["portable.shift"]
    assert list(tuner.choices) == [tuner.last_key] and tuner.sources[tuner.last_key] == "benchmarked"


@triton.jit
def _double_kernel(x_ptr, y_ptr, n, N_BUCKET, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def _toy_tuner(benchmarks: list) -> tuning.TableAutotuner:
    """A toy kernel under :class:`tuning.TableAutotuner` (not registered), three configs, the prune
    leaving one for n <= 16; its benchmark function counts its calls into ``benchmarks``."""
    def do_bench(kernel_call, quantiles=None):
        benchmarks.append(1)
        kernel_call()
        return [1.0, 1.0, 1.0]

    configs = [triton.Config({"BLOCK": b}, num_warps=w, num_stages=1) for b, w in ((16, 1), (32, 1), (64, 2))]
    def prune(configs, named_args, **kwargs):
        return configs[:1] if named_args["n"] <= 16 else configs

    return tuning.TableAutotuner("toy", _double_kernel, configs, ["N_BUCKET"], prune, do_bench=do_bench,
                                 cache_results=False)


def _toy_launch(tuner: tuning.TableAutotuner, n: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    y = torch.empty_like(x)
    tuner[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n, tuning.bucket(n))
    assert torch.equal(y, 2 * x)
    return y


def test_the_mechanism_on_this_triton_takes_no_benchmark(monkeypatch, tmp_path):
    """On a toy kernel (any Triton the kernels support, 3.6 included): a table entry's config runs with no
    benchmark function call; a prune that leaves one config is not benchmarked either (Triton 3.6 would
    benchmark it); another key benchmarks every config."""
    benchmarks: list = []
    tuner = _toy_tuner(benchmarks)
    entry = {"kernel": "toy", "key": {"N_BUCKET": 128}, "dtypes": ["torch.float32", "torch.float32"],
             "config": {"kwargs": {"BLOCK": 64}, "num_warps": 2, "num_stages": 1}}
    table = {"format": tuning.TABLE_FORMAT, "gpu": tuning.INTERPRETER_TABLE, "triton": triton.__version__,
             "source": {}, "entries": [entry]}
    monkeypatch.setenv(tuning.ENV, str(_write(tmp_path / TABLE, table)))
    _toy_launch(tuner, 100)
    assert tuner.sources[(128, "torch.float32", "torch.float32")] == "table" and not benchmarks
    assert tuner.choices[(128, "torch.float32", "torch.float32")].kwargs == {"BLOCK": 64}
    _toy_launch(tuner, 10)
    assert tuner.sources[(16, "torch.float32", "torch.float32")] == "one config" and not benchmarks
    _toy_launch(tuner, 300)
    assert tuner.sources[(512, "torch.float32", "torch.float32")] == "benchmarked" and len(benchmarks) == 3
    assert tuner.bench_calls == 3


BAD_CONFIGS = {
    "not in the pool": ({"SEQS": 4, "CENTRE_IN_G": False}, 1, "is not in the kernel's config pool"),
    "rejected by the prune": ({"SEQS": 1, "CENTRE_IN_G": False}, 2, "its prune rejects it for this call"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_bad_entry_warns_once_and_is_ignored(tuned, monkeypatch, tmp_path, case):
    out, picks, outputs = tuned
    kwargs, warps, why = BAD_CONFIGS[case]
    table = tuning.load_table(out / TABLE)
    for e in table["entries"]:
        if e["kernel"] == "packed":
            e["config"] = {"kwargs": kwargs, "num_warps": warps, "num_stages": 1}
    monkeypatch.setenv(tuning.ENV, str(_write(tmp_path / TABLE, table)))
    with pytest.warns(UserWarning, match=f"packed entry for key .* {why}.*ignored, autotuning this key"):
        _launch("temporal")
    packed = tuning.autotuners()["packed"]
    key = _only_key("packed")
    assert packed.sources[key] == "benchmarked" and packed.bench_calls == 4
    assert packed.choices[key] in packed.pool
    tuning.forget()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _launch("temporal")
    assert not [w for w in seen if "tuned table" in str(w.message)]  # once per process
    assert tuning.autotuners()["packed"].sources[key] == "benchmarked"


@pytest.mark.slow
def test_a_table_for_another_gpu_is_ignored_with_a_warning(tuned, monkeypatch, tmp_path):
    out, _, _ = tuned
    table = {**tuning.load_table(out / TABLE), "gpu": "NVIDIA H200"}
    monkeypatch.setenv(tuning.ENV, str(_write(tmp_path / "nvidia-h200.json", table)))
    with pytest.warns(UserWarning, match="is made for 'NVIDIA H200', not this 'triton-interpreter'; ignored"):
        _launch("temporal")
    assert tuning.autotuners()["packed"].sources[_only_key("packed")] == "benchmarked"


def test_a_missing_table_path_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match=r"PASA_TUNED='.*nope.json': no such file or folder; PASA_TUNED=0 turns"):
        tuning.active_table(torch.device("cpu"))


def test_a_malformed_table_is_refused_by_name(tmp_path):
    path = _write(tmp_path / "t.json", {"format": 1, "gpu": "x", "entries": [{"kernel": "packed"}]})
    with pytest.raises(ValueError, match=r"t.json: entry 0 needs 'kernel'"):
        tuning.load_table(path)


@pytest.mark.parametrize("gpu, name", [
    ("NVIDIA H200", "nvidia-h200"),
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
    ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb"),
    ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"),
    ("  AMD Instinct MI300X (gfx942) ", "amd-instinct-mi300x-gfx942"),
])
def test_gpu_names_normalise_to_file_stems(gpu, name):
    assert tuning.table_name(gpu) == name


def test_shipped_tables_are_package_data_and_fit_their_kernels():
    """Every committed table loads, names a known kernel by its key and holds a config of its pool's
    kind; the folder installs with the package."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "tuned/*.json" in data["pasa_diffusers.kernels"]
    assert tuning.TABLE_DIR.is_dir()
    tuners = tuning.autotuners()
    for path in sorted(tuning.TABLE_DIR.glob("*.json")):
        table = tuning.load_table(path)
        assert path.stem == tuning.table_name(table["gpu"]), path
        for entry in table["entries"]:
            tuner = tuners[entry["kernel"]]
            assert sorted(entry["key"]) == sorted(tuner.key_names), (path, entry)
            assert sorted(entry["config"]["kwargs"]) == sorted(tuner.pool[0].kwargs), (path, entry)



def test_tune_table_help_and_its_cpu_refusals(capsys, monkeypatch):
    with pytest.raises(SystemExit) as stop:
        tune_table.main(["--help"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m tools.tune_table")
    assert tune_table.main(["--shapes", "svd"]) == 2
    assert "only --shapes tiny runs, got --shapes svd" in capsys.readouterr().err
    assert tune_table.main(["--shapes", "tiny", "--methods", "sdpa"]) == 2
    assert "--methods takes our methods only" in capsys.readouterr().err
