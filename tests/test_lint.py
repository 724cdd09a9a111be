"""The tree passes ``ruff check`` under the configuration in pyproject.toml (``[tool.ruff]``).

ruff runs from the interpreter's own environment (it is in the ``test`` extra), so the suite checks with the version
it installs. The second test feeds ruff lines at and one past the limit under a path inside the tree: it fails if the
configuration stops being found or its limit changes, either of which would leave the first test checking less.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE_LENGTH = 120


def ruff_check(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args]
    return subprocess.run(command, cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60)


def test_the_tree_passes_ruff_check() -> None:
    result = ruff_check(str(ROOT))
    assert result.returncode == 0, f"ruff check reports:\n{result.stdout}{result.stderr}"


def probe_module(line_length: int) -> str:
    """A module of one line of exactly ``line_length`` characters."""
    prefix = 'TEXT = "'
    return prefix + "x" * (line_length - len(prefix) - 1) + '"\n'


def test_the_configuration_is_in_effect() -> None:
    probe = ("--stdin-filename", str(ROOT / "pipeline" / "lint_probe.py"), "-")
    over = ruff_check(*probe, stdin=probe_module(LINE_LENGTH + 1))
    assert over.returncode == 1 and "E501" in over.stdout, over.stdout + over.stderr
    at_limit = ruff_check(*probe, stdin=probe_module(LINE_LENGTH))
    assert at_limit.returncode == 0, at_limit.stdout + at_limit.stderr
