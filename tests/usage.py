"""What a server's command line prints when argparse refuses it."""

from __future__ import annotations

from typing import Callable

import pytest


def usage_error(run: Callable[[], object], capsys: pytest.CaptureFixture[str]) -> str:
    """The standard error of ``run`` (a parser's ``parse_args``, a ``main``), which must
    exit with argparse's status 2."""
    with pytest.raises(SystemExit) as ei:
        run()
    assert ei.value.code == 2
    return capsys.readouterr().err
