"""Cython hot loops. Each module `name.pyx` has a pure-Python twin `name_py.py` with equal results.

`load(name)` returns the compiled module when it was built (setup.py / `make install`) and the
twin otherwise. CONVEYOR_PURE_PYTHON=1 (`envs.PURE_PYTHON`) forces every twin; a comma-separated list of module
names (`CONVEYOR_PURE_PYTHON=penalties,bitmask`) forces those alone, so a benchmark can turn one off.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import envs


def load(name: str) -> ModuleType:
    if name not in envs.PURE_PYTHON.get():
        try:
            return importlib.import_module(f"ext.{name}")
        except ImportError:
            pass
    return importlib.import_module(f"ext.{name}_py")


def is_compiled(name: str) -> bool:
    return load(name).__name__ == f"ext.{name}"
