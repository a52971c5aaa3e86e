"""Docs that run: every Python block of README.md and docs/*.md, and every command line they show, is a case
here (``README.md:L8``), executed in a fresh process in a temporary directory.

``tests/docs/doc_blocks.py`` says which blocks are cases and defines the markers a page may put right above a
fence (HTML comments, invisible when rendered):

    <!-- doctest: skip reason="..." -->          not run (a real cluster, a GPU, the network, a make target)
    <!-- doctest: setup tiny-lm -->             run a named snippet first (model, optimizer, batch, loader)
    <!-- doctest: continue -->                  run after the previous Python block, in its interpreter
    <!-- doctest: replace "OLD" "NEW" -->       run with OLD replaced by NEW (tiny sizes, a simulated cluster)

A failure names the block's page and line; a traceback inside a block names the page's own line numbers.
Cases that start an embedded Ray carry the ``ray`` mark and must leave no Ray process behind.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docs import doc_blocks
from tests.docs.doc_blocks import DocBlockError, Piece

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(doc_blocks.__file__).resolve()
TIMEOUT_S = 300
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
OUTPUT_FLAGS = ("--out", "--plot", "--png", "--json")  # a command's files, checked to exist after it ran


def _params() -> list:
    params = []
    for case in doc_blocks.collect(ROOT):
        marks = [pytest.mark.skip(reason=case.skip_reason)] if case.skip_reason else []
        if case.uses_ray:
            marks.append(pytest.mark.ray)
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


def _env() -> dict[str, str]:
    """This environment without the test session's 8 fake devices in XLA_FLAGS (each case calls torchpar.init
    itself) but with its other XLA flags (the fast compile of ``tests/conftest.py``), with the repository importable;
    the session's JAX compilation cache is shared."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _run(argv: list[str], cwd: Path, case_id: str) -> subprocess.CompletedProcess:
    """Run in a process group of its own, killed whole (Ray's processes included) past the timeout."""
    process = subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{case_id} ran past {TIMEOUT_S} s\n--- stderr (tail) ---\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def _alive(pid: int, start: str) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == start and fields[0] != "Z"


def _python_case(case: doc_blocks.Case, tmp_path: Path) -> None:
    children = tmp_path / ".children.json"
    spec = tmp_path / ".case.json"
    spec.write_text(json.dumps({"pieces": [vars(p) for p in case.pieces], "children": str(children)}))
    result = _run([sys.executable, str(RUNNER), str(spec)], tmp_path, case.id)
    lines = ", ".join(f"{Path(p.filename).name}:L{p.line}" for p in case.pieces)
    assert result.returncode == 0, (f"{case.id} failed (exit {result.returncode}; ran {lines})\n"
                                    f"--- stdout (tail) ---\n{result.stdout[-2000:]}\n"
                                    f"--- stderr (tail) ---\n{result.stderr[-6000:]}")
    started = json.loads(children.read_text()) if children.exists() else []
    deadline = time.monotonic() + 30
    while (left := [pid for pid, start in started if _alive(pid, start)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"{case.id} left processes behind after torchpar.shutdown(): pids {left}"


def _shell_case(case: doc_blocks.Case, tmp_path: Path) -> None:
    argv = [sys.executable, *case.argv[1:]]
    if len(argv) > 1 and not argv[1].startswith("-") and (ROOT / argv[1]).exists():
        argv[1] = str(ROOT / argv[1])  # a script of the repository, run from the temporary directory
    result = _run(argv, tmp_path, case.id)
    assert result.returncode == 0, (f"{case.id} failed (exit {result.returncode}): {' '.join(case.argv)}\n"
                                    f"--- stdout (tail) ---\n{result.stdout[-2000:]}\n"
                                    f"--- stderr (tail) ---\n{result.stderr[-6000:]}")
    outputs = [value for flag, value in itertools.pairwise(argv) if flag in OUTPUT_FLAGS and value]
    missing = [name for name in outputs if not (tmp_path / name).exists()]
    assert not missing, f"{case.id} wrote no {missing}: {' '.join(case.argv)}\n{result.stdout[-2000:]}"


@pytest.mark.parametrize("case", _params())
def test_doc_block(case: doc_blocks.Case, tmp_path: Path) -> None:
    if case.kind == "python":
        _python_case(case, tmp_path)
    else:
        _shell_case(case, tmp_path)


# --- the extractor and the runner themselves ----------------------------------------------------------------

PAGE = '''# Page

```python
a = 1
```

<!-- doctest: continue -->
<!-- doctest: replace "range(100)" "range(2)" -->
```python
for _ in range(100):
    a += 1
```

<!-- doctest: setup tiny-lm -->
```py
engine = None
```

<!-- doctest: skip reason="needs a GPU" -->
```python
gpu()
```

```text
not code
```

<!-- doctest: replace "--steps 20" "--steps 2" -->
```bash
python examples/compare_loss.py --steps 20 \\
    --plot x.png   # a comment
.venv/bin/python -m torchpar plan --out p.html
```

<!-- doctest: skip reason="make target" -->
```bash
make test
```
'''


def test_extractor_ids_markers_and_lines(tmp_path):
    found = doc_blocks.cases(tmp_path / "page.md", tmp_path, PAGE)
    assert [c.id for c in found] == ["page.md:L3", "page.md:L9", "page.md:L15", "page.md:L20", "page.md:L30",
                                     "page.md:L32", "page.md:L37"]
    first, chained, with_setup, skipped, compare, plan, make = found
    assert first.pieces == (Piece(filename=str(tmp_path / "page.md"), line=4, source="a = 1\n"),)
    assert chained.pieces[0] == first.pieces[0] and chained.pieces[1].line == 10
    assert "range(2)" in chained.pieces[1].source and "range(100)" not in chained.pieces[1].source
    assert with_setup.pieces[0].source == doc_blocks.SETUPS["tiny-lm"] and with_setup.pieces[1].line == 16
    assert skipped.skip_reason == "needs a GPU" and first.skip_reason is None
    assert compare.argv == ("python", "examples/compare_loss.py", "--steps", "2", "--plot", "x.png")
    assert plan.argv[:3] == (".venv/bin/python", "-m", "torchpar")
    assert make.skip_reason == "make target" and not any(c.uses_ray for c in found)


@pytest.mark.parametrize("page, message", [
    ("<!-- doctest: frobnicate -->\n```python\nx\n```\n", "unknown doctest marker 'frobnicate'"),
    ("<!-- doctest: skip -->\n```python\nx\n```\n", "skip reason="),
    ("<!-- doctest: setup nope -->\n```python\nx\n```\n", "`setup` takes names"),
    ("<!-- doctest: continue -->\n```python\nx\n```\n", "`continue` with no Python block"),
    ("<!-- doctest: replace 'y' 'z' -->\n```python\nx\n```\n", "'y' does not occur"),
    ("<!-- doctest: skip reason=x -->\n\ntext\n```python\nx\n```\n", "not right above a ``` fence"),
    ("<!-- doctest: skip reason=x -->\n```text\nx\n```\n", "on a ```text block"),
    ("```bash\nmake demo\n```\n", "'make' is not a Python command"),
    ("```python\nx\n", "never closed"),
], ids=["unknown", "skip-without-reason", "unknown-setup", "continue-first", "replace-missing", "dangling",
        "marker-on-prose", "make-unmarked", "unclosed"])
def test_extractor_rejects(tmp_path, page, message):
    with pytest.raises(DocBlockError, match="page.md:") as error:
        doc_blocks.cases(tmp_path / "page.md", tmp_path, page)
    assert message in str(error.value)


def test_a_failing_block_names_its_page_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```python\nx = 1\nraise ValueError('boom')\n```\n")
    (case,) = doc_blocks.cases(page, tmp_path)
    with pytest.raises(AssertionError) as failure:
        _python_case(case, tmp_path)
    assert "page.md:L3 failed" in str(failure.value)
    assert f'File "{page}", line 5' in str(failure.value) and "ValueError: boom" in str(failure.value)


def test_every_page_is_collected():
    ids = {case.id.split(":")[0] for case in doc_blocks.collect(ROOT)}
    assert "README.md" in ids and len(ids) >= 5  # pages without code (docs/api.md) have no case
