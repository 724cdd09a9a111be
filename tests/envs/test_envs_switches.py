"""envs: each switch's parsing, its default, the entry a parent process sets for a child, and the registry's shape."""
from __future__ import annotations

import pytest

import envs
from envs import Flag, ModuleList

FLAG = Flag(envs.PREFIX + "TEST_FLAG", True, "a switch of this test alone")
MODULES = ModuleList(envs.PREFIX + "TEST_MODULES", "a switch of this test alone")


@pytest.mark.parametrize("value, on", [(None, True), ("", True), (" ", True), ("1", True), ("0", False),
                                       (" 0 ", False)])
def test_a_flag_reads_1_and_0_and_falls_back_to_its_default(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                                            on: bool) -> None:
    if value is None:
        monkeypatch.delenv(FLAG.name, raising=False)
    else:
        monkeypatch.setenv(FLAG.name, value)
    assert FLAG.get() is on
    assert Flag(FLAG.name, False, FLAG.reason).get() is (on if value and value.strip() else False)


@pytest.mark.parametrize("value", ["yes", "true", "2", "off"])
def test_a_flag_refuses_other_values_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(FLAG.name, value)
    with pytest.raises(ValueError, match=rf"{FLAG.name}='{value}': expected 1 \(on\) or 0 \(off\)"):
        FLAG.get()


def test_a_flag_is_read_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FLAG.name, "0")
    assert not FLAG.get()
    monkeypatch.setenv(FLAG.name, "1")
    assert FLAG.get()


@pytest.mark.parametrize("value, every, names", [
    (None, False, set()), ("", False, set()), ("0", False, set()), ("1", True, set()),
    ("penalties", False, {"penalties"}), (" bitmask , penalties ,", False, {"bitmask", "penalties"}),
    ("penalties,0", False, {"penalties"})])
def test_a_module_list_selects_every_module_or_the_named_ones(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                                              every: bool, names: set[str]) -> None:
    if value is None:
        monkeypatch.delenv(MODULES.name, raising=False)
    else:
        monkeypatch.setenv(MODULES.name, value)
    selection = MODULES.get()
    assert (selection.every, set(selection.names)) == (every, names)
    assert ("penalties" in selection) == (every or "penalties" in names)
    assert ("stop_strings" in selection) == every


def test_a_module_list_refuses_what_is_not_a_module_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODULES.name, "penalties;bitmask")
    with pytest.raises(ValueError, match=rf"{MODULES.name}='penalties;bitmask': 'penalties;bitmask' is not a module"):
        MODULES.get()


def test_a_setting_is_read_back_as_it_was_meant(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a parent puts into a child's environment (``setting``) is what the child's ``get`` reads."""
    for on in (True, False):
        for name, value in FLAG.setting(on).items():
            monkeypatch.setenv(name, value)
        assert FLAG.get() is on
    for every, names in ((True, ()), (False, ("penalties", "bitmask")), (False, ())):
        for name, value in MODULES.setting(every, names).items():
            monkeypatch.setenv(name, value)
        assert (MODULES.get().every, MODULES.get().names) == (every, frozenset(names))


def test_every_switch_is_named_once_with_its_prefix_and_a_one_line_reason() -> None:
    assert set(envs.SWITCHES) == {"CONVEYOR_DISABLE_TRITON", "CONVEYOR_PDL", "CONVEYOR_PURE_PYTHON",
                                  "CONVEYOR_LOCAL_WORKER"}
    for name, switch in envs.SWITCHES.items():
        assert switch.name == name and name.startswith(envs.PREFIX)
        assert switch.reason.strip() and "\n" not in switch.reason
    assert not envs.DISABLE_TRITON.default and envs.PDL.default and not envs.LOCAL_WORKER.default
