"""Rules the test suite keeps: a test never skips because one of the package's own modules fails to import (a
broken import must fail); `pytest.importorskip` is for optional third-party packages only. Every test directory is
collected (pytest's default `norecursedirs` names `dist`, and once silently kept tests/dist out of every run). The
modules the workers start first exist."""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_importorskip_of_the_packages_own_modules():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "importorskip" and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).split(".")[0] == "hybridtron"):
                offenders.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}: {node.args[0].value}")
    assert offenders == [], "import the package's modules directly; a broken import must fail:\n" + "\n".join(offenders)


def test_every_test_directory_is_collected():
    patterns = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
        "norecursedirs"]
    skipped = [str(path.parent.relative_to(TESTS.parent)) for path in TESTS.rglob("test_*.py")
               if any(fnmatch.fnmatch(part, pattern) for part in path.relative_to(TESTS).parts[:-1]
                      for pattern in patterns)]
    assert skipped == []
    assert "dist" not in patterns and (TESTS / "distributed" / "test_parallel_layouts.py").is_file()


def test_the_modules_scheduled_first_exist(pytestconfig):
    """A module renamed without tests/conftest.py would silently lose its place at the front of the queue, and a long
    module started last keeps one worker busy while the other waits."""
    conftest = pytestconfig.pluginmanager.get_plugin(str(TESTS / "conftest.py"))  # `import conftest` may be another
    assert [name for name in conftest.LONGEST_MODULES if not (TESTS.parent / name).is_file()] == []
    assert len(set(conftest.LONGEST_MODULES)) == len(conftest.LONGEST_MODULES)
