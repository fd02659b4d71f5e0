"""The build tools on a CPU (``tools/``): every one imports and answers ``--help`` as ``python -m tools.<name>``,
``python -m tools.tune_table --help`` runs from the repository root as a process, and the SASS reader of
``tools.compile_sm90`` finds the attention loop.  ``tests/test_tuned_configs.py`` runs ``tools.tune_table``
itself on the tiny shapes."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = ("tune_table", "compile_sm90", "compile_int8", "compile_portable")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", TOOLS)
def test_help(name, capsys):
    module = importlib.import_module(f"tools.{name}")
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m tools.{name}")
    assert "--out DIR" in out


@pytest.mark.slow
def test_runs_as_module_from_the_root():
    run = subprocess.run([sys.executable, "-m", "tools.tune_table", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: python -m tools.tune_table")


def test_key_loop_finds_the_innermost_attention_loop():
    """tools.compile_sm90.key_loop: the smallest backward-branch range holding a register-A MMA (P V) and an
    exp2, with its opcode counts (predicates dropped); a loop without them, or none, is not it."""
    from tools.compile_sm90 import key_loop

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;",
        "        /*0020*/                   MUFU.EX2 R5, R5 ;",
        "        /*0030*/                   FSEL R6, R5, -INF , P1 ;",
        "        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR12].tnspB, R24 ;",
        "        /*0050*/               @P0 BRA 0x10 ;",
        "        /*0060*/                   FADD R7, R7, R8 ;",
        "        /*0070*/              @!P1 BRA 0x0 ;",
        "        /*0080*/                   MUFU.EX2 R9, R9 ;",
        "        /*0090*/                   BRA 0x80 ;",
    ])
    assert key_loop(sass) == {"loop_sass": 5, "loop_ops": "HGMMA 2, MUFU 1, FSEL 1, BRA 1"}
    assert key_loop("\n".join(sass.splitlines()[:3])) == {"loop_sass": None, "loop_ops": None}


def test_key_loop_prefers_the_coded_loop_of_an_8_bit_kernel():
    """An 8-bit kernel has two loops with ``P V`` and exp2: the coded tiles' (holding the INT8 IGMMA) and the
    smaller 16-bit blocks' after it; key_loop reports the coded one."""
    from tools.compile_sm90 import key_loop

    sass = "\n".join([
        "        /*0000*/                   IGMMA.64x128x32.S32.S8.S8 R24, gdesc[UR4], RZ ;",
        "        /*0010*/                   FMUL R6, R5, R4 ;",
        "        /*0020*/                   MUFU.EX2 R5, R5 ;",
        "        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR12].tnspB, R24 ;",
        "        /*0040*/               @P0 BRA 0x0 ;",
        "        /*0050*/                   MUFU.EX2 R9, R9 ;",
        "        /*0060*/                   HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR12].tnspB, R24 ;",
        "        /*0070*/               @P1 BRA 0x50 ;",
    ])
    assert key_loop(sass) == {"loop_sass": 5, "loop_ops": "IGMMA 1, FMUL 1, MUFU 1, HGMMA 1, BRA 1"}
