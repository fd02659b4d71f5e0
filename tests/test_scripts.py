"""The GPU scripts of ``scripts/`` on a machine without a GPU: one line saying so, exit status 2, nothing written.

They are run as ``scripts/README.md`` runs them (``PYTHONPATH=$PWD python scripts/<name>.py``), with
``CUDA_VISIBLE_DEVICES=""`` so that a GPU machine sees none either.  (Each was a torch CUDA traceback: the
driver's or "Found no NVIDIA driver", from its first tensor on ``cuda``.)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, args, message", [
    ("ab_key_ranges.py", ["--out", "{out}"], "scripts/ab_key_ranges.py: needs a CUDA GPU (it times the default's "
                                             "launches against cuDNN); none on this machine (torch "),
    ("ab_bits.py", ["--save", "{out}/new.pt"], "scripts/ab_bits.py --save: needs a CUDA GPU (it runs every kernel "
                                               "path); none on this machine (torch "),
    ("host_parts.py", [], "scripts/host_parts.py: needs a CUDA GPU (it times the host's parts of a call while the GPU "
                          "sleeps); none on this machine (torch "),
], ids=["ab_key_ranges", "ab_bits", "host_parts"])
def test_a_gpu_script_without_a_gpu_is_one_line(script, args, message, tmp_path):
    out = tmp_path / "out"
    env = {**{key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"},
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *(a.format(out=out) for a in args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr[-3000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(message), done.stderr[-3000:]
    assert not out.exists()
