"""The console script under test: ``pasa`` as installed beside this interpreter (``pip install -e .`` puts it in
the interpreter's ``bin/``), found through ``sys.executable`` and not through PATH, where another environment's
``pasa`` may come first and run another checkout's code (or none be found, in a venv used without activating)."""
from __future__ import annotations

import signal
import sys
from pathlib import Path

PASA = str(Path(sys.executable).with_name("pasa"))


def default_sigint() -> None:
    """In a child before exec (``preexec_fn``): SIGINT to its default, so that Python installs its Ctrl-C handler
    there, as in a user's terminal.  A suite started as a background job of a non-interactive shell (``pytest &``)
    inherits SIGINT ignored, and Python leaves an ignored SIGINT ignored: a command sent Ctrl-C would run on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


_BATCH = r'''
import contextlib, io, json, os, sys, traceback
from pathlib import Path
from pasa_diffusers.cli import main

HEAVY = ("torch", "diffusers", "transformers")
root, answers = Path.cwd(), []
for index, (argv, env) in enumerate(json.load(sys.stdin)):
    folder = root / str(index)
    folder.mkdir()
    os.chdir(folder)
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            status = 1
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    answers.append({"status": status, "stdout": out.getvalue(), "stderr": err.getvalue(),
                    "heavy": [name for name in HEAVY if name in sys.modules], "left": sorted(os.listdir(folder))})
json.dump(answers, sys.__stdout__)
'''


def run_batch(calls: list[tuple[list[str], dict[str, str]]], cwd: Path) -> list[dict]:
    """Answer many ``pasa`` argument lists in one fresh interpreter (no ``TRITON_INTERPRET`` unless a call's
    environment sets it): each ``cli.main(argv)`` runs in its own empty folder under ``cwd`` with its
    environment settings, and comes back as its exit status, stdout, stderr, the heavy modules (torch,
    diffusers, transformers) imported by the time it returned (the calls run in order, so the first call to
    import one is the one that shows it) and what it left in its folder.  One process instead of one per
    call: the suite starts ~90 fewer interpreters."""
    import json
    import os
    import subprocess

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _BATCH], input=json.dumps(calls), capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout)
    assert len(answers) == len(calls)
    return answers
