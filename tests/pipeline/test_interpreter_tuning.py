"""While an engine serves, the GC and GIL settings are the serving ones; shutdown puts back the old."""
from __future__ import annotations

import gc
import sys

from pipeline.engine import Engine
from pipeline.interpreter_tuning import InterpreterSettings, restore, tune_for_serving
from tests.conftest import run_async
from tests.engine_utils import config_for


def test_tune_and_restore_round_trip():
    before = InterpreterSettings.current()
    frozen_before = gc.get_freeze_count()
    kept = [[i] for i in range(1000)]  # tracked objects alive across the freeze
    previous = tune_for_serving(12_345, 0.002)
    try:
        assert previous == before
        assert gc.get_threshold()[0] == 12_345 and gc.get_threshold()[1:] == before.gc_threshold[1:]
        assert sys.getswitchinterval() == 0.002
        assert gc.get_freeze_count() >= frozen_before + len(kept)
    finally:
        restore(previous)
    assert InterpreterSettings.current() == before and gc.get_freeze_count() == 0


def test_an_engine_applies_its_config_while_it_runs(tiny_model_dir):
    before = InterpreterSettings.current()

    async def main():
        engine = await Engine.create(config_for(tiny_model_dir, gc_young_threshold=4321, gil_switch_interval_s=0.0007))
        try:
            return gc.get_threshold()[0], sys.getswitchinterval()
        finally:
            await engine.shutdown()

    assert run_async(main()) == (4321, 0.0007)
    assert InterpreterSettings.current() == before
