"""The CPU backend's threads: the cores the process may use, `--cpu-threads`, OpenMP's passive wait, the banner."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cli.main import main
from pipeline import cpu_threads
from pipeline.config import EngineConfig
from pipeline.cpu_threads import prefer_passive_wait, usable_cores
from tests.conftest import run_async
from tests.engine_utils import config_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_usable_cores_follow_the_affinity_mask_and_the_cgroup_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5})
    absent = tmp_path / "absent"
    assert usable_cores(absent) == 3
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # 1.5 cores of quota: 2 threads
    assert usable_cores(quota) == 2
    quota.write_text("50000 100000\n")
    assert usable_cores(quota) == 1
    quota.write_text("max 100000\n")
    assert usable_cores(quota) == 3
    quota.write_text("garbage")
    assert usable_cores(quota) == 3


def test_config_resolves_the_thread_count_on_the_cpu_only(monkeypatch):
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 3)
    assert EngineConfig(device="cpu").resolved().cpu_threads == 3
    assert EngineConfig(device="cpu", cpu_threads=1).resolved().cpu_threads == 1
    assert EngineConfig(device="cuda").resolved().cpu_threads is None
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(device="cpu", cpu_threads=0).validate()


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_cli_refuses_a_bad_thread_count_in_one_line(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--cpu-threads", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--cpu-threads" in err and "Traceback" not in err


def run_python(code: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=environment,
                          check=True, timeout=120).stdout.strip()


def test_passive_wait_is_asked_before_torch_loads_and_never_over_the_environment():
    code = ("import os; from pipeline.cpu_threads import prefer_passive_wait as p; took = p(); import torch; "
            "print(took, os.environ['OMP_WAIT_POLICY'], p())")
    assert run_python(code) == "True PASSIVE False"
    assert run_python(code, OMP_WAIT_POLICY="active") == "True active False"
    # the command line, and the entry the expert-parallel head starts its local workers with, ask before they import
    # anything that loads torch
    assert run_python("import sys, cli.main; print('torch' in sys.modules)") == "False"
    assert run_python("import sys, pipeline.dist.local_worker; print('torch' in sys.modules)") == "False"
    assert not prefer_passive_wait()  # this process has torch already


def test_engine_runs_its_steps_on_the_thread_count_and_restores_it(tiny_model_dir):
    from pipeline.engine import Engine
    from web.serve import banner

    before = torch.get_num_threads()

    async def scenario() -> tuple[int, str, int]:
        engine = await Engine.create(config_for(tiny_model_dir, cpu_threads=1))
        try:
            on_device_thread = await engine.executor.call(torch.get_num_threads)
            return on_device_thread, banner(engine, "http://127.0.0.1:1"), torch.get_num_threads()
        finally:
            await engine.shutdown()

    on_device_thread, text, during = run_async(scenario())
    assert on_device_thread == during == 1
    assert f"CPU threads  1 of {usable_cores()} usable cores, OpenMP wait" in text
    assert torch.get_num_threads() == before
