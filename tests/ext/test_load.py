"""ext.load: CONVEYOR_PURE_PYTHON forces every twin ("1") or the named ones alone."""
from __future__ import annotations

import pytest

import ext
from tests.ext.twins import compiled_module


@pytest.mark.parametrize("value, twins", [("1", {"penalties", "bitmask"}), ("penalties", {"penalties"}),
                                          (" bitmask , penalties ", {"penalties", "bitmask"}), ("0", set()),
                                          ("", set())])
def test_the_variable_names_the_forced_twins(monkeypatch: pytest.MonkeyPatch, value: str, twins: set[str]) -> None:
    monkeypatch.setenv("CONVEYOR_PURE_PYTHON", value)
    for name in ("penalties", "bitmask"):
        loaded = ext.load(name).__name__
        if name in twins or compiled_module(name) is None:
            assert loaded == f"ext.{name}_py"
        else:
            assert loaded == f"ext.{name}"
