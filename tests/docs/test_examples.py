"""Every runnable example in README.md and docs/*.md runs, and prints what it shows
(the convention: :mod:`tests.docs.examples`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.examples import REPO, blocks, commands, doc_files, output_matches, run_block, runnable

pytestmark = pytest.mark.timeout(300)

EXAMPLES = [b for path in doc_files() for b in runnable(blocks(path))]


@pytest.mark.parametrize("block", EXAMPLES, ids=[b.where for b in EXAMPLES])
def test_example_runs_and_prints_what_it_shows(block) -> None:
    run_block(block)


def test_the_readme_has_examples_to_check() -> None:
    readme = [b for b in EXAMPLES if b.path.name == "README.md"]
    assert sum(len(commands(b)) for b in readme if b.lang == "console") >= 3


# -- the checker itself can fail ------------------------------------------------------------
DOC = """\
# t

```console
$ echo hello
hello
$ echo one; echo two; echo three
one
...
three
$ echo 'a long line'
a ... line
```

```console no-run
$ exit 1
```

```python
print("ok")
```

```python no-run
raise SystemExit(1)
```

```sh
exit 1
```
"""


def _doc(tmp_path: Path, text: str) -> list:
    path = tmp_path / "doc.md"
    path.write_text(text)
    return runnable(blocks(path))


def test_good_examples_pass_and_no_run_or_other_fences_are_skipped(tmp_path: Path) -> None:
    bs = _doc(tmp_path, DOC)
    assert [(b.lang, b.line) for b in bs] == [("console", 3), ("python", 18)]
    for b in bs:
        run_block(b, cwd=tmp_path)


def test_a_failing_command_names_its_file_and_line(tmp_path: Path) -> None:
    (b,) = _doc(tmp_path, "intro\n\n```console\n$ echo fine\n$ python -c 'import sys; sys.exit(3)'\n```\n")
    with pytest.raises(AssertionError) as err:
        run_block(b, cwd=tmp_path)
    assert f"{tmp_path / 'doc.md'}:3: console block, command at line 5" in str(err.value)
    assert "exited 3" in str(err.value)


def test_drifted_output_fails_and_shows_both(tmp_path: Path) -> None:
    (b,) = _doc(tmp_path, "```console\n$ echo 448\n576\n```\n")
    with pytest.raises(AssertionError, match=r"(?s)doc.md:1: .*printed something other than the output shown\n--- shown ---\n576\n--- printed ---\n448"):
        run_block(b, cwd=tmp_path)


def test_a_failing_python_block_names_its_file_and_line(tmp_path: Path) -> None:
    (b,) = _doc(tmp_path, "x\n```python\nimport pdgrpc.no_such_module\n```\n")
    with pytest.raises(AssertionError, match=r"(?s)doc.md:2: python block\nexited 1.*No module named 'pdgrpc.no_such_module'"):
        run_block(b, cwd=tmp_path)


def test_output_matching_rules() -> None:
    assert output_matches(["a", "...", "d"], "a\nb\nc\nd\n")
    assert output_matches(["a", "...", "b"], "a\nb")
    assert not output_matches(["a", "d"], "a\nb\nd\n")
    assert output_matches(["x ... z  "], "x y z")
    assert not output_matches(["a"], "a\nmore\n")  # every printed line is accounted for
    assert output_matches([], "anything")


def test_docs_live_where_the_test_looks() -> None:
    assert (REPO / "README.md") in doc_files() and (REPO / "docs" / "performance.md") in doc_files()
