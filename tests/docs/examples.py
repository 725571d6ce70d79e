"""Find and run the examples in README.md and docs/*.md.

The convention (docs authors rely on it):

* a fenced ```console block is a shell session: each line that starts with ``$ `` is a
  command (a line ending in ``\\`` continues on the next), run with ``bash -c`` from the
  repository root with the test's virtual environment first on ``PATH`` (so ``python``
  is the one pdgrpc is installed in). It must exit 0. The lines after it, up to the next
  command, are its expected standard output: a line ``...`` stands for any number of
  lines, ``...`` inside a line for any text; trailing spaces are ignored. No lines: any
  output.
* a fenced ```python block is a script, run on its own in an empty temporary folder; it
  must exit 0.
* ```console no-run / ```python no-run: shown, never run (long-running servers,
  benchmarks, commands that need other hosts). Any other fence is not run.

Every command or script runs with a timeout (:data:`TIMEOUT_S`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0
RUN_LANGS = ("console", "python")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    no_run: bool
    body: tuple[str, ...]

    @property
    def where(self) -> str:
        try:
            shown = self.path.relative_to(REPO)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}"


def doc_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a markdown file, with their language and no-run flag."""
    lines = (path.read_text() if text is None else text).splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").split()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i][len(m.group("indent")):] if lines[i].startswith(m.group("indent")) else lines[i])
            i += 1
        i += 1  # the closing fence
        out.append(Block(path, start + 1, info[0] if info else "", "no-run" in info[1:], tuple(body)))
    return out


def runnable(bs: list[Block]) -> list[Block]:
    return [b for b in bs if b.lang in RUN_LANGS and not b.no_run]


def commands(block: Block) -> list[tuple[int, str, list[str]]]:
    """(line, command, expected output lines) for each ``$ `` command of a console block."""
    out: list[tuple[int, str, list[str]]] = []
    lines = list(block.body)
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("$ "):
            if out:
                out[-1][2].append(line)
            elif line.strip():
                raise AssertionError(f"{block.where}: console block: text before the first `$ ` command: {line!r}")
            i += 1
            continue
        at = block.line + 1 + i
        cmd = line[2:]
        while cmd.endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd = cmd[:-1] + "\n" + lines[i]
        out.append((at, cmd, []))
        i += 1
    return out


def output_matches(expected: list[str], actual: str) -> bool:
    want = [ln.rstrip() for ln in expected]
    while want and not want[-1]:
        want.pop()
    if not want:
        return True
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if ln == "..." else re.escape(ln).replace(re.escape("..."), r"[^\n]*") + r"\n" for ln in want
    )
    got = "\n".join(ln.rstrip() for ln in actual.splitlines()).rstrip("\n") + "\n"
    return re.fullmatch(pattern, got) is not None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["COLUMNS"] = "80"  # argparse wraps --help to the terminal's width
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _show(text: str, limit: int = 3000) -> str:
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def run_block(block: Block, cwd: Path = REPO) -> None:
    """Run one example; AssertionError naming its file, line and what went wrong."""
    if block.lang == "console":
        for line, cmd, expected in commands(block):
            where = f"{block.where}: console block, command at line {line}: $ {cmd}"
            try:
                p = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=_env(), capture_output=True, text=True,
                                   timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{where}\ndid not finish in {TIMEOUT_S:.0f} s (mark the fence `console no-run`?)") from None
            if p.returncode != 0:
                raise AssertionError(f"{where}\nexited {p.returncode}\n--- stdout ---\n{_show(p.stdout)}\n--- stderr ---\n{_show(p.stderr)}")
            if not output_matches(expected, p.stdout):
                raise AssertionError(
                    f"{where}\nprinted something other than the output shown\n--- shown ---\n" + "\n".join(expected)
                    + f"\n--- printed ---\n{_show(p.stdout)}"
                )
    elif block.lang == "python":
        with tempfile.TemporaryDirectory(prefix="pdgrpc-docs-") as tmp:
            script = Path(tmp) / "example.py"
            script.write_text("\n".join(block.body) + "\n")
            where = f"{block.where}: python block"
            try:
                p = subprocess.run([sys.executable, str(script)], cwd=tmp, env=_env(), capture_output=True, text=True,
                                   timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{where}\ndid not finish in {TIMEOUT_S:.0f} s (mark the fence `python no-run`?)") from None
            if p.returncode != 0:
                raise AssertionError(f"{where}\nexited {p.returncode}\n--- stdout ---\n{_show(p.stdout)}\n--- stderr ---\n{_show(p.stderr)}")
