"""Cython hot loops. Each module `name.pyx` has a pure-Python twin `name_py.py` with equal results.

`load(name)` returns the compiled module when it was built (setup.py / `make install`) and the
twin otherwise; CONVEYOR_PURE_PYTHON=1 forces the twins (benchmarks compare both).
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType


def load(name: str) -> ModuleType:
    if os.environ.get("CONVEYOR_PURE_PYTHON") != "1":
        try:
            return importlib.import_module(f"ext.{name}")
        except ImportError:
            pass
    return importlib.import_module(f"ext.{name}_py")


def is_compiled(name: str) -> bool:
    return load(name).__name__ == f"ext.{name}"
