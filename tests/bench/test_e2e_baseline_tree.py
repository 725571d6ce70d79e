"""bench e2e's --baseline-tree: the older build's routers use local sockets where it has them."""

from __future__ import annotations

from pathlib import Path

from pdgrpc.bench import e2e


def test_a_tree_with_local_sockets_is_compared_over_them(tmp_path: Path) -> None:
    (tmp_path / "pdgrpc" / "rpc").mkdir(parents=True)
    assert not e2e.has_local_sockets(str(tmp_path))  # a tree from before them: its servers lack --local-socket
    (tmp_path / "pdgrpc" / "rpc" / "local.py").write_text("")
    assert e2e.has_local_sockets(str(tmp_path))
    assert e2e.has_local_sockets(str(Path(e2e.__file__).parents[2]))  # this checkout
