"""EngineConfig.resolved: the device is named and every unset field takes that device's default."""
from __future__ import annotations

import pytest
import torch

from pipeline.config import CPU_DEFAULTS, CUDA_DEFAULTS, CUDA_GRAPH_MAX_BATCH, EngineConfig


def test_cpu_takes_the_cpu_defaults() -> None:
    config = EngineConfig(device="cpu").resolved()
    assert (config.device, config.max_num_seqs, config.max_num_batched_tokens) == (
        "cpu", CPU_DEFAULTS.max_num_seqs, CPU_DEFAULTS.max_num_batched_tokens)
    config.validate()


def test_cuda_takes_the_cuda_defaults_and_graphs_up_to_the_seats() -> None:
    config = EngineConfig(device="cuda:1").resolved()  # naming a device needs no GPU to resolve
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (CUDA_DEFAULTS.max_num_seqs,
                                                                    CUDA_DEFAULTS.max_num_batched_tokens)
    assert config.cuda_graph_max_batch == min(CUDA_DEFAULTS.max_num_seqs, CUDA_GRAPH_MAX_BATCH)
    assert EngineConfig(device="cuda", max_num_seqs=24).resolved().cuda_graph_max_batch == 24
    assert EngineConfig(device="cuda", max_num_seqs=4096).resolved().cuda_graph_max_batch == CUDA_GRAPH_MAX_BATCH


def test_set_fields_are_kept() -> None:
    config = EngineConfig(device="cuda", max_num_seqs=7, max_num_batched_tokens=99, cuda_graph_max_batch=3)
    resolved = config.resolved()
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens, resolved.cuda_graph_max_batch) == (7, 99, 3)
    assert config.max_num_seqs == 7 and config.device == "cuda"  # the original is not changed


@pytest.mark.parametrize("visible, device", [(False, "cpu"), (True, "cuda")])
def test_auto_picks_cuda_when_visible(monkeypatch: pytest.MonkeyPatch, visible: bool, device: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
    assert EngineConfig().resolved().device == device


def test_serve_help_names_both_devices_defaults() -> None:
    import argparse

    from cli.main import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = parser.format_help()
    for value in (CUDA_DEFAULTS.max_num_seqs, CPU_DEFAULTS.max_num_seqs, CUDA_DEFAULTS.max_num_batched_tokens,
                  CPU_DEFAULTS.max_num_batched_tokens):
        assert f"{value} on" in text


def test_prefix_caching_is_on_unless_the_flag_says_no() -> None:
    import argparse

    from cli.main import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args([])).prefix_caching
    assert not engine_config(parser.parse_args(["--no-prefix-caching"])).prefix_caching


def test_the_flags_reach_exact_speculation_and_the_head_split() -> None:
    import argparse

    from cli.main import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    plain = engine_config(parser.parse_args([]))
    assert not plain.exact_speculation and plain.ep_split_linear_attention is None
    args = ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--exact-speculation",
            "--no-ep-split-linear-attention"]
    config = engine_config(parser.parse_args(args))
    assert config.exact_speculation and config.ep_split_linear_attention is False
    config.validate()
    with pytest.raises(ValueError, match="exact_speculation"):
        engine_config(parser.parse_args(["--exact-speculation"])).validate()
