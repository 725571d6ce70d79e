"""``python -m pdgrpc.cluster`` flags: a bad value is one line on stderr and exit 2, before any process starts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import pytest

from pdgrpc.cluster.__main__ import build_parser, build_restart_parser, main


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_log_dir_that_cannot_be_a_directory_is_refused(where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "taken"
    file.write_text("not a directory")
    log_dir = file if where == "a file" else file / "logs"
    assert main(["1p1d", "--log-dir", str(log_dir)]) == 2
    out = capsys.readouterr()
    assert f"error: --log-dir {str(log_dir)!r} cannot be made a directory" in out.err
    assert "Traceback" not in out.err and "starting" not in out.out


@pytest.mark.parametrize(
    "parser, argv",
    [
        (build_parser, ["1p1d", "--start-timeout", "0"]),
        (build_parser, ["1p1d", "--start-timeout", "-1"]),
        (build_restart_parser, ["router", "--log-dir", ".", "--timeout", "0"]),
    ],
)
def test_a_wait_of_0_or_less_is_refused(
    parser: Callable[[], argparse.ArgumentParser], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # Taken, the launcher would start every process, then give up on them at once.
    with pytest.raises(SystemExit) as ei:
        parser().parse_args(argv)
    assert ei.value.code == 2
    assert f"argument {argv[-2]}: must be a finite number of seconds > 0, got {argv[-1]}" in capsys.readouterr().err
