"""Conveyor's environment switches: the one reader of ``CONVEYOR_*`` variables, each switch a typed entry with its
default and the reason it exists.

Why a top-level package of its own: imports go one way (web -> pipeline -> kernels/ext), and switches are read in
all of those layers (kernels/ decides Triton and dependent launch, ext/ its compiled modules, pipeline/ its expert-
parallel workers). A leaf that imports only the standard library can be imported by every layer without an upward
edge, which ``pipeline/`` or ``kernels/`` could not be.

Every switch is read from the environment when ``get()`` is called, not at import: a test or a debugging session
that sets a variable sees it on the next call. Code that needs one value for a process caches it itself (dependent
launch is decided once per device, ``kernels/triton_compat.py``). A value a switch does not accept raises a
``ValueError`` naming the variable and what it takes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

PREFIX = "CONVEYOR_"  # every switch's name starts with it; no other variable of that name is read anywhere


@dataclass(frozen=True, slots=True)
class Flag:
    """An on/off switch: ``1`` on, ``0`` off, unset or empty its default."""

    name: str
    default: bool
    reason: str

    def get(self) -> bool:
        value = os.environ.get(self.name, "").strip()
        if not value:
            return self.default
        if value not in ("0", "1"):
            raise ValueError(f"{self.name}={value!r}: expected 1 (on) or 0 (off)")
        return value == "1"

    def setting(self, on: bool) -> dict[str, str]:
        """The environment entry that sets this switch, for a process this one starts."""
        return {self.name: "1" if on else "0"}


@dataclass(frozen=True, slots=True)
class ModuleSelection:
    """What a module-list switch chose: every module, or the named ones alone (none when ``names`` is empty)."""

    every: bool
    names: frozenset[str]

    def __contains__(self, module: str) -> bool:
        return self.every or module in self.names


@dataclass(frozen=True, slots=True)
class ModuleList:
    """A switch naming modules: ``1`` every module, a comma-separated list those alone, unset, empty or ``0`` none."""

    name: str
    reason: str

    def get(self) -> ModuleSelection:
        value = os.environ.get(self.name, "").strip()
        if value == "1":
            return ModuleSelection(True, frozenset())
        names = frozenset(part.strip() for part in value.split(",")) - {"", "0"}
        if bad := sorted(n for n in names if not n.isidentifier()):
            raise ValueError(f"{self.name}={value!r}: {', '.join(map(repr, bad))} is not a module name "
                             f"(expected 1, 0, or module names separated by commas)")
        return ModuleSelection(False, names)

    def setting(self, every: bool = False, names: tuple[str, ...] = ()) -> dict[str, str]:
        """The environment entry that selects every module or ``names``, for a process this one starts."""
        return {self.name: "1" if every else ",".join(names) or "0"}


Switch = Flag | ModuleList

DISABLE_TRITON = Flag(
    "CONVEYOR_DISABLE_TRITON", False,
    "run the torch references on a CUDA device: isolates a kernel bug from a model bug, and reads layouts (an fp8 "
    "KV cache on any GPU) the kernels do not")
PDL = Flag(
    "CONVEYOR_PDL", True,
    "programmatic dependent launch on Hopper and later; off measures or rules out the overlap of kernel starts")
PURE_PYTHON = ModuleList(
    "CONVEYOR_PURE_PYTHON",
    "load ext/'s pure-Python twins instead of the compiled modules (all, or the named ones): what a compiled module "
    "buys, and a machine where one misbehaves")
LOCAL_WORKER = Flag(
    "CONVEYOR_LOCAL_WORKER", False,
    "set by `conveyor serve --ep-size N` for the workers it starts itself: they meet it through its store and end "
    "with it")

SWITCHES: dict[str, Switch] = {switch.name: switch for switch in (DISABLE_TRITON, PDL, PURE_PYTHON, LOCAL_WORKER)}
