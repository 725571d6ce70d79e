"""``python -m pdgrpc.cluster`` flags: a bad value is one line on stderr and exit 2, before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdgrpc.cluster.__main__ import main


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_log_dir_that_cannot_be_a_directory_is_refused(where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "taken"
    file.write_text("not a directory")
    log_dir = file if where == "a file" else file / "logs"
    assert main(["1p1d", "--log-dir", str(log_dir)]) == 2
    out = capsys.readouterr()
    assert f"error: --log-dir {str(log_dir)!r} cannot be made a directory" in out.err
    assert "Traceback" not in out.err and "starting" not in out.out
