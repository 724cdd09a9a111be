"""Cython hot loops. Each module `name.pyx` has a pure-Python twin `name_py.py` with equal results.

`load(name)` returns the compiled module when it was built (setup.py / `make install`) and the
twin otherwise. CONVEYOR_PURE_PYTHON=1 forces every twin; a comma-separated list of module names
(`CONVEYOR_PURE_PYTHON=penalties,bitmask`) forces those alone, so a benchmark can turn one off.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType


def forced_twins() -> frozenset[str] | bool:
    """True: every module's twin; else the names whose twin is forced."""
    value = os.environ.get("CONVEYOR_PURE_PYTHON", "").strip()
    if value == "1":
        return True
    return frozenset(name.strip() for name in value.split(",") if name.strip() and name.strip() != "0")


def load(name: str) -> ModuleType:
    forced = forced_twins()
    if not (forced is True or name in forced):
        try:
            return importlib.import_module(f"ext.{name}")
        except ImportError:
            pass
    return importlib.import_module(f"ext.{name}_py")


def is_compiled(name: str) -> bool:
    return load(name).__name__ == f"ext.{name}"
