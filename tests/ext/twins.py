"""The compiled module and its pure-Python twin, as pytest parameters (the compiled one skips when
the extension was not built)."""
from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def compiled_module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"ext.{name}")
    except ImportError:  # not built
        return None


def twin_and_compiled(name: str) -> list:
    compiled = compiled_module(name)
    return [pytest.param(importlib.import_module(f"ext.{name}_py"), id="twin"),
            pytest.param(compiled, id="compiled", marks=pytest.mark.skipif(compiled is None, reason="not built"))]
