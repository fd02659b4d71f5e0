"""``pasa`` command line: parse arguments, call library functions, print.

One module per subcommand (``numerics``, ``generate``, ``compare``, ``diagnose``), each with
``add_parser`` and ``run``; ``common`` holds the arguments they share.
"""
from __future__ import annotations

import argparse
import sys

from . import compare, diagnose, generate, numerics

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pasa", description="PASA: overflow-free FP16 attention for video diffusion")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (numerics, generate, compare, diagnose):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
