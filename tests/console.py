"""The console script under test: ``pasa`` as installed beside this interpreter (``pip install -e .`` puts it in
the interpreter's ``bin/``), found through ``sys.executable`` and not through PATH, where another environment's
``pasa`` may come first and run another checkout's code (or none be found, in a venv used without activating)."""
from __future__ import annotations

import sys
from pathlib import Path

PASA = str(Path(sys.executable).with_name("pasa"))
