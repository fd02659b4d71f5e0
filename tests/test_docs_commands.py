"""Every command line README.md and docs/*.md show runs as written: through the real ``pasa`` console
script, on the CPU, on the built-in tiny models.

The convention for a fenced block of commands (its info string):

- ```` ```bash ````: commands this test runs on the CPU, in order, in one scratch folder per document (so a
  command may read what an earlier one of the same document wrote; nothing lands in the checkout), without
  network (``HF_HUB_OFFLINE=1``).  Each must exit 0.
- ```` ```bash gpu ```` (needs a CUDA GPU), ```` ```bash hub ```` (needs a hub id or the network), or both words:
  listed, not run.  Each ``pasa`` command in them is parsed by the real argument parser (so a renamed flag or
  command fails here; a literal ``...`` stands for more flags and is left out; a value that names a file or a
  package of the other machine is not checked), and each ``python -m MODULE``, ``python FILE`` or ``bash FILE``
  must name a module or file of the checkout.
- any other block (output, code, a folder tree) shows no command: a line that starts with one (``pasa``,
  ``python``, ``torchrun``, ``pip``, ...) fails the check, so no command escapes this test unmarked.

In a command block a leading ``pip install ... &&`` is dropped (the package is installed), a ``pytest`` command
is not run (it is this suite), comments after ``#`` are dropped and lines ending in ``\\`` are joined.

``DATED`` lists the documents left out, those that record what was run on their day rather than commands to run
now (none since the journal left docs/ for git history: ``git show 426b706:docs/HISTORY.md``).  ``TOO_SLOW``
lists the ``bash`` commands listed but not run because one run takes minutes on the 2-core CPU machine (each is
parsed like a GPU one; the test fails when one of them is no longer in the documents, so the list cannot go stale).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.console import PASA

ROOT = Path(__file__).resolve().parents[1]

DATED: tuple[str, ...] = ()
"""Documents whose commands are a dated record, not instructions (module docstring)."""

TOO_SLOW = {
    "pasa numerics --out out/numerics": "the paper's grid: 4.2 min on the 2-core machine",
    "pasa numerics --zero-mean-v --out out/numerics_v0": "the paper's grid, zero-mean V: 11 min on the 2-core machine "
                                                         "(shared)",
}
"""``bash`` commands (as written, comments dropped) listed but not run, and why."""

KINDS = {"gpu", "hub"}
"""The words that may follow ``bash`` in an info string: what a listed block needs."""

COMMAND_WORDS = {"pasa", "python", "python3", "torchrun", "pip", "pip3", "pytest", "bash", "sh", "huggingface-cli"}
"""The first words (after ``NAME=value`` settings) that make a line a command."""

COMMAND_TIMEOUT_S = 600


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str
    """The command as the shell runs it: continuations joined, the comment dropped."""

    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    """The line of the opening fence (1-based)."""
    info: str
    body: tuple[str, ...]

    def commands(self) -> list[Command]:
        """Its logical lines, continuations joined and comments dropped, each with the line it starts on."""
        commands, pending, start = [], "", 0
        for offset, raw in enumerate(self.body, start=self.line + 1):
            if not pending:
                start = offset
            pending += raw
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            text = " ".join(strip_comment(pending).split())
            if text:
                commands.append(Command(self.doc, start, text))
            pending = ""
        assert not pending, f"{self.doc}:{start}: a command ends in a line continuation"
        return commands


def strip_comment(line: str) -> str:
    """``line`` without its shell comment: a ``#`` outside quotes, at the start or after blank space."""
    quote, escaped = None, False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


@functools.lru_cache(maxsize=None)
def blocks(doc: str) -> list[Block]:
    """The fenced code blocks of ``doc`` (a path relative to the checkout), CommonMark's way: a fence of three
    or more backticks or tildes, closed by one of the same character at least as long."""
    found, fence, info, start, body = [], None, "", 0, []
    for number, line in enumerate((ROOT / doc).read_text().splitlines(), start=1):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence, info, start, body = match.group(1), match.group(2).strip(), number, []
        elif match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) and not match.group(2).strip():
            found.append(Block(doc, start, info, tuple(body)))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{doc}:{start}: a fenced block is never closed"
    return found


DOCS = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md"))
                       if str(p.relative_to(ROOT)) not in DATED)]


def kind(block: Block) -> set[str] | None:
    """``set()`` for a ``bash`` block (run), the words after it for a listed one, ``None`` for any other."""
    words = block.info.split()
    if not words or words[0] != "bash":
        return None
    return set(words[1:])


def _words(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise AssertionError(f"{text}: not a shell command ({exc})") from exc


def _program(words: list[str]) -> list[str]:
    """``words`` without leading ``NAME=value`` settings."""
    i = 0
    while i < len(words) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[i]):
        i += 1
    return words[i:]


def runnable(command: Command) -> str | None:
    """What the shell runs for a ``bash`` block's command: ``None`` for a ``pytest`` command (this suite) and a
    bare ``pip install``; a leading ``pip install ... &&`` dropped."""
    text = command.text
    words = _program(_words(text))
    if words[:2] in (["pip", "install"], ["pip3", "install"]):
        if "&&" not in text:
            return None
        text = text.split("&&", 1)[1].strip()
        words = _program(_words(text))
    if words[:1] == ["pytest"] or words[:3] in (["python", "-m", "pytest"], ["python3", "-m", "pytest"]):
        return None
    return text


def run_commands(doc: str) -> list[tuple[Command, str]]:
    """The commands of ``doc`` this test runs, in order, each with what the shell runs."""
    found = []
    for block in blocks(doc):
        if kind(block) == set():
            for command in block.commands():
                text = runnable(command)
                if text is not None and text not in TOO_SLOW:
                    found.append((command, text))
    return found


def listed_commands(doc: str) -> list[Command]:
    """The commands of ``doc`` that are listed, not run: those of ``bash gpu``/``bash hub`` blocks and
    ``TOO_SLOW``."""
    found = []
    for block in blocks(doc):
        words = kind(block)
        if words:
            found += block.commands()
        elif words == set():
            found += [c for c in block.commands() if runnable(c) in TOO_SLOW]
    return found


# ------------------------------------------------------------------------------------------ the checks


def _parse_pasa(argv: list[str], where: str) -> None:
    """Parse ``pasa`` arguments with the real parser; only a value naming a file or package of another machine
    may fail its check."""
    from pasa_diffusers.cli import build_parser
    from pasa_diffusers.cli import _ArgumentError

    try:
        build_parser().parse_args([word for word in argv if word != "..."])
    except _ArgumentError as exc:
        if not re.search(r"no such file or folder|which is not installed", str(exc)):
            raise AssertionError(f"{where}: {exc.prog}: {exc}") from None


def _check_listed(command: Command) -> None:
    """A listed command: its ``pasa`` arguments parse; the module, script or file it runs is in the checkout."""
    words = _program(_words(command.text))
    where = command.where()
    assert words, f"{where}: no program"
    program = next((i for i, word in enumerate(words) if word == "pasa" and (i == 0 or words[i - 1] == "--no-python")),
                   None)  # pasa ..., or torchrun ... --no-python pasa ...
    if program is not None:
        _parse_pasa(words[program + 1:], where)
        return
    program, rest = words[0], words[1:]
    if program in ("python", "python3", "torchrun"):
        if "-m" in rest:
            module = rest[rest.index("-m") + 1]
            if str(ROOT) not in sys.path:
                sys.path.insert(0, str(ROOT))
            assert importlib.util.find_spec(module) is not None, f"{where}: no module {module} in the checkout"
            return
        script = next((w for w in rest if w.endswith(".py")), None)
        assert script is not None and (ROOT / script).is_file(), f"{where}: no script {script} in the checkout"
    elif program in ("bash", "sh"):
        assert rest and (ROOT / rest[0]).is_file(), f"{where}: no script {rest[:1]} in the checkout"
    elif program in ("pip", "pip3", "pytest", "huggingface-cli"):
        return
    else:
        raise AssertionError(f"{where}: unknown program {program!r}")


@pytest.mark.parametrize("doc", DOCS)
def test_every_command_block_is_marked_and_every_listed_command_parses(doc):
    """A block showing a command is ``bash``, ``bash gpu`` or ``bash hub``; a listed command parses."""
    for block in blocks(doc):
        words = kind(block)
        if words is None:
            for number, line in enumerate(block.body, start=block.line + 1):
                program = _program(strip_comment(line).split())
                assert not (program and program[0] in COMMAND_WORDS), (
                    f"{doc}:{number}: {line.strip()!r} is a command in a block marked {block.info or 'nothing'!r}; "
                    "mark the block ```bash (run on the CPU by this test), ```bash gpu or ```bash hub")
        else:
            assert words <= KINDS, (f"{doc}:{block.line}: ```{block.info}: unknown kind "
                                    f"{sorted(words - KINDS)}; expected bash, bash gpu or bash hub")
    for command in listed_commands(doc):
        _check_listed(command)


def test_every_too_slow_command_is_still_shown():
    shown = {c.text for doc in DOCS for block in blocks(doc) if kind(block) == set() for c in block.commands()}
    stale = sorted(set(TOO_SLOW) - shown)
    assert not stale, f"TOO_SLOW lists commands no document shows any more: {stale}"


def _environment(folder: Path) -> dict[str, str]:
    """The user's shell: the console script first on PATH, the checkout importable (``python -m bench...``),
    no Triton interpreter, no network, Hugging Face's cache of this machine; one OpenMP thread, as the other
    console-script suites (with another process on one of the two cores, OpenMP's spinning threads made a
    tiny run up to 100x slower: the README's pasa compare 457 s instead of 27 s)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = os.pathsep.join([str(Path(PASA).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    env["HOME"] = env.get("HOME", str(folder))
    return env


RUN_DOCS = [doc for doc in DOCS if run_commands(doc)]


@pytest.mark.slow
@pytest.mark.parametrize("doc", RUN_DOCS)
def test_every_bash_command_runs_as_written(doc, tmp_path, monkeypatch, capsys):
    """Each ``bash`` command of ``doc`` exits 0, run in order in one scratch folder."""
    env = _environment(tmp_path)
    for command, text in run_commands(doc):
        start = time.perf_counter()
        if _in_process(text):
            done = _run_pasa_here(_words(text)[1:], tmp_path, monkeypatch, capsys)
        else:
            done = subprocess.run(["bash", "-c", text], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S)
        seconds = time.perf_counter() - start
        print(f"{seconds:6.1f} s  {command.where()}")
        assert done.returncode == 0, (f"{command.where()}\nexited {done.returncode} after {seconds:.1f} s; "
                                      f"stderr ends:\n{done.stderr[-3000:]}\nstdout ends:\n{done.stdout[-1000:]}")


def _in_process(text: str) -> bool:
    """A plain ``pasa ...`` command (no settings before it, no shell operator): run as ``cli.main`` in this
    process, which parses the same argv the console script does (the console script itself is tested in
    test_errors and test_cli); ``python -m``, ``torchrun`` and anything the shell must interpret stay processes."""
    return _words(text)[:1] == ["pasa"] and not re.search(r"[|&;<>$`(){}*?]", text)


def _run_pasa_here(argv: list[str], folder: Path, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """``pasa ARGV`` through ``cli.main`` in ``folder``, without network (the hub's offline switch, read at its
    import, set on its constants) and without Triton's interpreter, as ``_environment`` gives a process."""
    import huggingface_hub.constants

    from pasa_diffusers.cli import main

    monkeypatch.chdir(folder)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    capsys.readouterr()
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["pasa", *argv], status, out, err)
