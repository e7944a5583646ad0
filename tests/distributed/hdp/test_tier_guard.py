"""The tier is the path (tests/conftest.py, tests/unit/conftest.py): a unit test that starts a process fails,
naming what it started, even when it catches that failure; a test marked ``fast``/``dist``/``slow`` by hand, or a
test file outside tests/<tier>/<area>/, stops the run.  Run as pytest runs, in a subprocess, on a tree holding
copies of the two conftests and a probe file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]

PROBE = """
import multiprocessing
import subprocess
import sys


def test_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_multiprocessing():
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()


def test_caught():
    try:
        subprocess.run([sys.executable, "-c", "pass"])
    except BaseException:
        pass


def test_no_process():
    assert sum(range(4)) == 6
"""


def _tree(tmp_path: Path) -> Path:
    """A checkout's tests/ in miniature: the two conftests and an empty tests/unit/hdp/."""
    root = tmp_path / "repo"
    (root / "tests" / "unit" / "hdp").mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", root / "tests" / "conftest.py")
    shutil.copy(TESTS / "unit" / "conftest.py", root / "tests" / "unit" / "conftest.py")
    return root


def _pytest(root: Path, *args: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=root,
                         capture_output=True, text=True, timeout=600)
    return out.returncode, out.stdout + out.stderr


def test_a_unit_test_that_starts_a_process_fails_naming_it(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "tests" / "unit" / "hdp" / "test_probe.py").write_text(PROBE)
    code, out = _pytest(root, "tests")
    assert code == 1, out[-4000:]
    assert "3 failed, 1 passed" in out, out[-4000:]
    for what in ("(subprocess.Popen)", "(a multiprocessing process)", "the test caught the failure"):
        assert what in out, (what, out[-4000:])


def test_a_hand_marker_or_a_file_outside_the_tiers_stops_the_run(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    marked = root / "tests" / "unit" / "hdp" / "test_marked.py"
    marked.write_text("import pytest\n\n\n@pytest.mark.slow\ndef test_x():\n    pass\n")
    code, out = _pytest(root, "tests")
    assert code == 4 and "marked 'slow' by hand" in out, out[-4000:]
    marked.unlink()
    (root / "tests" / "test_flat.py").write_text("def test_x():\n    pass\n")
    code, out = _pytest(root, "tests")
    assert code == 4 and "a test file lives in tests/<tier>/<area>/" in out, out[-4000:]
