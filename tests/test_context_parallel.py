"""PASA under diffusers' context parallelism, on the CPU: tiny Wan and LTX-Video in gloo process groups.

This file is also the worker: ``torchrun --nproc-per-node N tests/test_context_parallel.py OUT SEED CASE...``
runs each named case (``CASES``: a family, a ``ContextParallelConfig``, a backend) in the group and has
rank 0 write every rank's output and counters to ``OUT/results.pt``.  The tests launch it twice (2
processes: Ulysses 2 and ring 2; 4 processes: Ulysses 2 x ring 2), killed after ``LAUNCH_TIMEOUT``, and
compare with the same backend in this one process.

Tolerance.  A context-parallel run computes the same exact attention with PASA's roundings (fp16 q, k, v
and P, fp32 softmax state), placed differently: Ulysses runs each head on the same full sequence (it
measured bit-identical here, but row blocking of the surrounding GEMMs may differ elsewhere); the ring
splits the keys, so each chunk has its own row maximum (P rounds differently), each chunk's output is
rounded to fp16 and the merged output once more.  Both outputs are within PASA's own rounding error of
the FP32-attention output ``y32``; by the triangle inequality the two differ by at most twice that
error: ``rms(y_cp - y_1) <= 2 rms(y_1 - y32)``, with ``y_1`` this process's output.  Measured over 16
seeds: 0 (Ulysses) and 0.45-0.69 of ``rms(y_1 - y32)`` (ring, both), so the bound has 3x margin
(the paper's PASA, whose LSE is less accurate than its output, docs/NUMERICS.md: 0.87-1.05); it
is about 1e-4 of the output's RMS, and the control (the same sharded model with its processors' parallel
config removed, every rank attending to its own shard) misses it by orders of magnitude.  FP32 attention
(SDPA on fp32 copies, gathered keys in the ring) is held to fp32 rounding: ``rms <= 1e-6 rms(y32)``.
"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pasa_diffusers import install, parallel
from pasa_diffusers.pipelines.video_dits import TEXT_TOKENS, example_inputs, tiny_transformer

LAUNCH_TIMEOUT = 240
"""Seconds one torchrun launch may take (about 20 s for 2 processes, 30 s for 4 on two shared cores)."""

CASES: dict[str, tuple[str, dict[str, int], str]] = {
    "wan-ulysses": ("wan", {"ulysses_degree": 2}, "pasa"),
    "wan-ring": ("wan", {"ring_degree": 2}, "pasa"),
    "ltx-ulysses": ("ltx-video", {"ulysses_degree": 2}, "pasa"),
    "ltx-ring": ("ltx-video", {"ring_degree": 2}, "pasa"),
    "wan-ring-fp32": ("wan", {"ring_degree": 2}, "fp32"),
    "wan-ring-paper": ("wan", {"ring_degree": 2}, "pasa-paper"),
    "wan-both": ("wan", {"ulysses_degree": 2, "ring_degree": 2}, "pasa"),
    "ltx-both": ("ltx-video", {"ulysses_degree": 2, "ring_degree": 2}, "pasa"),
}
"""Case name -> (family, ContextParallelConfig arguments, backend)."""

LAUNCHES = {2: ["wan-ulysses", "wan-ring", "ltx-ulysses", "ltx-ring", "wan-ring-fp32", "wan-ring-paper"],
            4: ["wan-both", "ltx-both"]}
"""Processes -> the cases one launch runs."""

SCHEDULES = {
    "wan-ulysses": {"ulysses": 2}, "wan-ring": {"ring": 2}, "wan-both": {"ulysses+ring": 2},
    "ltx-ulysses": {"ulysses": 2, "gathered": 2}, "ltx-ring": {"ring": 2, "gathered": 2},
    "ltx-both": {"ulysses+ring": 2, "gathered": 2}, "wan-ring-fp32": {"gathered": 2}, "wan-ring-paper": {"ring": 2},
}
"""How each case's context-parallel calls must have run: two blocks' self-attention in diffusers' schedule;
LTX-Video's text cross-attention (a padding mask) gathered; SDPA (no LSE) gathered in the ring.  Wan's
cross-attention carries no parallel config (its text is not sharded): a plain call."""

CALLS = 4
"""Attention calls of one forward of either tiny model (2 blocks x self and cross)."""

KEPT_TEXT = 3
"""LTX-Video's text: 8 tokens (divisible by 2 and 4 ranks), the first 3 kept: with 2 ranks the second
rank's whole shard is padding, with 4 ranks two shards are."""


def inputs(family: str, model: torch.nn.Module, seed: int) -> dict[str, Any]:
    """``example_inputs`` of ``family``; LTX-Video's prompt padded to 8 tokens, ``KEPT_TEXT`` kept (its plan
    shards the text and its mask)."""
    gen = torch.Generator().manual_seed(seed)
    kwargs = example_inputs(family, model, gen)
    if family == "ltx-video":
        text = kwargs["encoder_hidden_states"]
        extra = torch.randn(text.shape[0], 8 - TEXT_TOKENS, text.shape[2], generator=gen)
        kwargs["encoder_hidden_states"] = torch.cat([text, extra], dim=1)
        mask = torch.zeros(text.shape[0], 8, dtype=torch.long)
        mask[:, :KEPT_TEXT] = 1
        kwargs["encoder_attention_mask"] = mask
    return kwargs


def _forward(model: torch.nn.Module, kwargs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**kwargs)[0]


def _rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


# ---- the worker (one process of a torchrun launch) ----------------------------------------------

def _run_case(name: str, seed: int) -> dict[str, Any]:
    """One case on this rank: its output, counters and schedules, and the checks that need the group."""
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    family, degrees, backend = CASES[name]
    model = tiny_transformer(family)
    kwargs = inputs(family, model, seed)
    install.apply(model, backend)
    parallel.enable_parallelism(model, ContextParallelConfig(**degrees))
    out = _forward(model, kwargs)
    result: dict[str, Any] = {"out": out, "summary": install.fallback_summary(model),
                              "schedules": parallel.schedule_summary(model)}
    if name == "wan-ring":
        # the other order (parallelism enabled, then apply) computes the same
        other = tiny_transformer(family)
        parallel.enable_parallelism(other, ContextParallelConfig(**degrees))
        install.apply(other, backend)
        result["other_order_equal"] = torch.equal(_forward(other, kwargs), out)
        # restore puts the stock processors back with the config, and a later apply carries it again
        install.restore(other)
        selfs = [p for key, p in install.attention_processors(other).items() if key.endswith("attn1.processor")]
        result["restored_with_config"] = bool(selfs) and all(p._parallel_config is other._parallel_config
                                                             for p in selfs)
        install.apply(other, "fp32")
        result["fp32_after_restore"] = _forward(other, kwargs)
        # the control: every rank attends to its own shard only
        for processor in install.attention_processors(other).values():
            processor._parallel_config = None
        result["control"] = _forward(other, kwargs)
        # forward-only: grad mode with parameters that require grad is refused
        try:
            model(**kwargs)
            result["grad_error"] = None
        except RuntimeError as error:
            result["grad_error"] = str(error)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return {"ranks": gathered}


def _worker(argv: list[str]) -> None:
    import torch.distributed as dist

    out_dir, seed, names = Path(argv[0]), int(argv[1]), argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        results = {name: _run_case(name, seed) for name in names}
        if dist.get_rank() == 0:
            torch.save(results, out_dir / "results.pt")
    finally:
        dist.destroy_process_group()


# ---- the tests ----------------------------------------------------------------------------------

GLOO_ABORT = "terminate called without an active exception"
"""What a gloo worker prints when it aborts in its own threads (SIGABRT): seen only while the other pytest worker
loads both CPU cores (2 of the last 4 full suites on the 2-core machine; none alone, 20 of 20 then)."""


def _launch(nproc: int, names: list[str], seed: int, out_dir: Path) -> dict[str, Any]:
    """Run the worker on ``names`` in ``nproc`` gloo processes (torchrun, standalone); its results.  A run whose
    worker aborted in gloo (:data:`GLOO_ABORT`) is launched once more; any other failure, or a second abort, fails."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(Path(__file__).resolve()), str(out_dir), str(seed), *names]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for attempt in range(2):
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the workers it started
            log, _ = proc.communicate()
            pytest.fail(f"torchrun --nproc-per-node {nproc} ran past {LAUNCH_TIMEOUT} s:\n{log[-4000:]}")
        if proc.returncode == 0 or GLOO_ABORT not in log:
            break
    assert proc.returncode == 0, log[-4000:]
    return torch.load(out_dir / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def seed() -> int:
    value = int(os.environ.get("PASA_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed={value}")
    return value


@pytest.fixture(scope="module")
def results(seed, tmp_path_factory) -> dict[str, Any]:
    """Every case's results: one launch per process count of ``LAUNCHES``."""
    found: dict[str, Any] = {}
    for nproc, names in LAUNCHES.items():
        found.update(_launch(nproc, names, seed, tmp_path_factory.mktemp(f"cp{nproc}")))
    return found


@pytest.fixture(scope="module")
def single(seed) -> dict[tuple[str, str], torch.Tensor]:
    """This one process's output of each (family, backend), and of FP32 attention."""
    outs = {}
    for family, backend in {(family, backend) for family, _, backend in CASES.values()} | {
            (family, "fp32") for family, _, _ in CASES.values()}:
        model = tiny_transformer(family)
        install.apply(model, backend)
        outs[family, backend] = _forward(model, inputs(family, model, seed))
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_equals_one_process(name, results, single):
    family, _, backend = CASES[name]
    one, fp32 = single[family, backend], single[family, "fp32"]
    bound = 1e-6 * _rms(fp32) if backend == "fp32" else 2.0 * _rms(one - fp32)
    assert 0 < bound < 1e-3 * _rms(one)
    for rank, result in enumerate(results[name]["ranks"]):
        assert result["out"].shape == one.shape
        assert torch.isfinite(result["out"]).all()
        diff = _rms(result["out"] - one)
        print(f"{name} rank {rank}: rms(cp - one) = {diff:.3e} = {diff / bound * 2:.2f} x rms(one - fp32) "
              f"(bound 2; one-process PASA's own rms error {_rms(one - fp32):.3e})" if backend != "fp32" else
              f"{name} rank {rank}: rms(cp - one) = {diff:.3e} = {diff / _rms(one):.1e} x rms(one)")
        assert diff <= bound, (name, rank, diff, bound)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_call_is_the_backends_own(name, results):
    for result in results[name]["ranks"]:
        assert result["summary"]["calls"] == CALLS
        assert result["summary"]["fallback_calls"] == 0, result["summary"]["fallbacks"]
        assert result["schedules"] == SCHEDULES[name]


@pytest.mark.slow
def test_order_restore_control_and_grad(results, single):
    one, fp32 = single["wan", "pasa"], single["wan", "fp32"]
    for result in results["wan-ring"]["ranks"]:
        assert result["other_order_equal"]
        assert result["restored_with_config"]
        assert _rms(result["fp32_after_restore"] - fp32) <= 1e-6 * _rms(fp32)
        assert _rms(result["control"] - one) > 100 * 2.0 * _rms(one - fp32)
        assert result["grad_error"] is not None and "forward-only" in result["grad_error"]


def test_a_model_without_a_plan_is_named():
    from diffusers import ContextParallelConfig

    model = tiny_transformer("hunyuan-video")
    with pytest.raises(ValueError, match="HunyuanVideoTransformer3DModel has no context-parallel plan"):
        parallel.enable_parallelism(model, ContextParallelConfig(ring_degree=2))


def test_bench_help(capsys):
    from bench import context_parallel

    with pytest.raises(SystemExit) as stop:
        context_parallel.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m bench.context_parallel") and "--out DIR" in out


@pytest.mark.slow
def test_bench_on_cpus_counts_processes_and_leaves_no_collective_unwaited(tmp_path):
    """``torchrun ... -m bench.context_parallel`` on the CPU (2 gloo processes, the tiny Wan, the ring): the table
    counts processes, not GPUs, and has no peak-memory column (a CPU has no GPU memory); the SDPA ring row, whose
    diffusers backend (``native``) has no LSE, is skipped saying why, before the ring's all-gather (it ran, failed
    on its first chunk and left that collective unwaited: torch warned at exit on every rank)."""
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "bench.context_parallel", "--model", "tiny-wan", "--modes", "ring", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun ran past {LAUNCH_TIMEOUT} s:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-4000:]
    assert "unwaited" not in log, log[-4000:]
    table = [line for line in (tmp_path / "context_parallel.md").read_text().splitlines() if line.startswith("|")]
    assert table[0] == ("| processes | mode | backend | forward ms | rel. RMS vs same, 1 process | rel. RMS vs SDPA, "
                        "1 process | finite | fallback calls | schedules / error |")
    assert not any("GPU" in line for line in table), table
    rows = {tuple(cell.strip() for cell in line.split("|")[1:4]): line for line in table[2:]}
    assert set(rows) == {("1", "1 process", "sdpa (native)"), ("1", "1 process", "pasa"), ("2", "ring", "sdpa (native)"),
                         ("2", "ring", "pasa")}
    assert "skipped: diffusers' native backend has no log-sum-exp" in rows["2", "ring", "sdpa (native)"]
    assert "ring 4" in rows["2", "ring", "pasa"]  # 2 forwards (the checked one, one timed) x 2 attention layers


if __name__ == "__main__":
    _worker(sys.argv[1:])
