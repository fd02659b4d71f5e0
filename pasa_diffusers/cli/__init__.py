"""``pasa`` command line: parse arguments, call library functions, print.

One module per subcommand (``numerics``, ``generate``, ``compare``, ``diagnose``, ``coverage``, ``save_model``
for ``save-model``, ``warmup``), each with ``add_parser`` and ``run`` and optionally ``validate`` (raises
``UsageError``, called before ``run``);
``common`` holds the arguments they share.  Every argument is checked before torch or diffusers is
imported.  A user mistake prints one line ``pasa <command>: error: <message>`` to stderr and exits 2;
a traceback is shown only with ``--debug`` (or ``PASA_DEBUG=1``) or for an internal error.  Ctrl-C
prints ``pasa <command>: interrupted (Ctrl-C)`` and exits 130 (``compare``: how many results are done), at any
moment: one that lands while a module is being imported (the first seconds import torch, diffusers and
transformers) takes effect once that import is done (``held_while_importing``), since a ``KeyboardInterrupt``
raised inside a library's import leaves it half made, and the libraries turn that into import errors.  A command
whose arguments pass starts with a one-line warning when ``TRITON_INTERPRET`` turns Triton's
interpreter on (every kernel then runs in numpy on the CPU: for tests, far too slow for a real run).
``pasa --version`` prints the versions a bug report needs (``version_lines``) and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

from .. import env
from ..pipelines import quiet
from . import compare, coverage, diagnose, generate, numerics, save_model, warmup
from .common import UsageError

__all__ = ["main", "build_parser", "interpreter_warning", "version_lines", "held_while_importing"]

_COMMANDS = (numerics, generate, compare, diagnose, coverage, save_model, warmup)
_NAMES = {command.__name__.rsplit(".", 1)[-1].replace("_", "-"): command for command in _COMMANDS}
"""Command name (``save-model`` for the module ``save_model``) -> its module."""


_FLAGS = ("PASA_DEBUG", "TRITON_INTERPRET")
"""The environment flags ``pasa`` reads (``env.flag``), checked before anything else."""


def interpreter_warning() -> str | None:
    """The warning line for a ``TRITON_INTERPRET`` that turns Triton's interpreter on (``env.flag``: Triton 3's
    reading), else ``None``."""
    if not env.flag("TRITON_INTERPRET"):
        return None
    value = os.environ["TRITON_INTERPRET"]
    return (f"pasa: warning: TRITON_INTERPRET={value} is set: the PASA kernels run in Triton's interpreter "
            "(numpy on the CPU, hundreds of times slower; meant for tests); unset it for real runs")


PACKAGE = "pasa-diffusers"
VERSIONED = ("diffusers", "transformers", "triton")
"""The packages ``pasa --version`` names beside the package, Python and torch (read from their metadata: no import)."""


def version_lines() -> list[str]:
    """What ``pasa --version`` prints, to quote in a bug report: this package's version, then Python's, torch's (with
    its CUDA build and the GPU it sees, so torch is imported) and those of ``VERSIONED``."""
    import importlib.metadata
    import platform

    import torch

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    gpu = (f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no CUDA device")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    return [f"{PACKAGE} {version(PACKAGE)}",
            f"python {platform.python_version()}, torch {torch.__version__} ({build}, {gpu}), "
            + ", ".join(f"{name} {version(name)}" for name in VERSIONED)]


class _VersionAsked(Exception):
    """``--version`` was given: ``main`` prints ``version_lines`` and returns 0."""


class _Version(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, *args: object) -> NoReturn:
        raise _VersionAsked


class _ArgumentError(Exception):
    """An argparse error, raised instead of argparse's usage-and-exit so ``main`` prints one line."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _ArgumentError(self.prog, message)


def build_parser() -> argparse.ArgumentParser:
    """The ``pasa`` parser: the global ``--debug`` flag and one subparser per command."""
    parser = _Parser(prog="pasa", description="PASA: overflow-free FP16 attention for video diffusion")
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of every error (also: environment PASA_DEBUG=1)")
    parser.add_argument("--version", action=_Version,
                        help="print the versions of pasa-diffusers, Python, torch (its CUDA, the GPU), diffusers, "
                             "transformers and triton, for a bug report, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS:
        command.add_parser(sub)
    for subparser in sub.choices.values():  # also accepted after the command: pasa generate --debug
        subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _debug(argv: list[str]) -> bool:
    return "--debug" in argv or env.flag("PASA_DEBUG")


_IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
"""The file names of the frames of Python's import system: a frame below one of them is a module being imported."""
RETRY_S = 0.01
"""How soon a Ctrl-C held during an import is delivered again (and held again while the import goes on)."""


def _importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` (the one a signal interrupted) runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename in _IMPORT_MACHINERY:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def held_while_importing() -> Iterator[None]:
    """Within the block, a Ctrl-C (SIGINT) that lands inside an import is held and delivered again every
    ``RETRY_S`` until it lands outside one, where it raises ``KeyboardInterrupt`` as usual.

    A ``KeyboardInterrupt`` raised inside a module's top-level code leaves that module half made: numpy's lazy
    ``linalg`` then recursed without end, transformers reported ``Could not import module 'PreTrainedModel'``,
    and diffusers chained both into a ``RuntimeError`` (exit 1); some libraries even swallowed it.  The block
    changes nothing outside the main thread (where no signal handler can be set) or where SIGINT is not Python's
    default (ignored, as in a shell script's background job, or handled by the caller)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pending: list[threading.Timer] = []  # the one delivery in flight, however many times Ctrl-C is pressed

    def deliver_again() -> None:
        pending.clear()
        os.kill(os.getpid(), signal.SIGINT)

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if not _importing(frame):
            raise KeyboardInterrupt
        if not pending:
            pending.append(threading.Timer(RETRY_S, deliver_again))
            pending[0].daemon = True
            pending[0].start()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        for timer in pending:  # the block is over (its work done): no signal after the handler is gone
            timer.cancel()


def main(argv: list[str] | None = None) -> int:
    """Run ``pasa`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with held_while_importing():
        return _main(argv)


def _close_progress_bars() -> None:
    """Close the progress bars an interrupt left open (a bar over a loop's items is closed only when its iterator
    is collected), so that the interrupt's line starts on a line of its own."""
    std = sys.modules.get("tqdm.std")
    if std is not None:
        for bar in list(std.tqdm._instances):
            bar.close()


def _main(argv: list[str]) -> int:
    prog = "pasa"
    try:
        for name in _FLAGS:
            env.flag(name)
    except env.EnvFlagError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        args = build_parser().parse_args(argv)
        prog = f"pasa {args.command}"
        quiet.show(_debug(argv))  # diffusers', transformers' and the hub's logs and warnings only with --debug
        module = _NAMES[args.command]
        if hasattr(module, "validate"):
            module.validate(args)
        warning = interpreter_warning()
        if warning is not None:
            print(warning, file=sys.stderr, flush=True)
        if args.command in warmup.ANNOUNCED:
            warmup.announce_compiling()
        return args.func(args)
    except _VersionAsked:
        print("\n".join(version_lines()))
        return 0
    except KeyboardInterrupt:
        if _debug(argv):
            raise
        _close_progress_bars()
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr)
        return compare.INTERRUPTED
    except _ArgumentError as exc:
        if _debug(argv):
            raise
        command = next((a for a in argv if a in _NAMES), None)  # "unrecognized arguments" comes from the top
        prog = f"pasa {command}" if exc.prog == "pasa" and command else exc.prog
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except UsageError as exc:
        if _debug(argv):
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
