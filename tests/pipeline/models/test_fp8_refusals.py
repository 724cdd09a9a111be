"""Checkpoints no path here loads are refused with one line naming the method, field or tensor: an unknown
quant_method, settings of a known one that have no path (static activation scales, 4-bit compressed-tensors), an FP8
weight without its scale, a scale of the wrong shape or without its weight, FP8 tensors without a
quantization_config, a KV scale that is not one positive value. The check runs on the headers before anything loads
(`checkpoint_problem`), loading raises the same CheckpointError, and `conveyor serve` / `generate` exit 1 with that
line alone, before binding the port."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.errors import CheckpointError
from pipeline.models.quantized_weights import checkpoint_problem
from tests.fp8_checkpoints import to_block_fp8

ROOT = Path(__file__).resolve().parents[3]
WEIGHT = "model.layers.0.self_attn.q_proj.weight"
SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"


@pytest.fixture(scope="module")
def fp8_dir(make_model_dir) -> Path:
    directory = make_model_dir("qwen3", seed=8, hidden_size=160, intermediate_size=200)
    to_block_fp8(directory)
    return directory


def edited(fp8_dir: Path, tmp_path: Path, tensors=None, config=None) -> Path:
    """A copy of the FP8 checkpoint with ``tensors(dict)`` and ``config(dict)`` applied to its files."""
    directory = tmp_path / "model"
    shutil.copytree(fp8_dir, directory)
    if tensors is not None:
        with safe_open(directory / "model.safetensors", framework="pt") as handle:
            data = {name: handle.get_tensor(name) for name in handle.keys()}
        tensors(data)
        save_file(data, directory / "model.safetensors")
    if config is not None:
        content = json.loads((directory / "config.json").read_text())
        config(content)
        (directory / "config.json").write_text(json.dumps(content))
    return directory


def quantization(**fields):
    return lambda config: config["quantization_config"].update(fields)


CASES = {
    "unknown method": (None, quantization(quant_method="awq"), "quant_method 'awq' is not supported"),
    "static activations": (None, quantization(activation_scheme="static"), "activation_scheme 'static'"),
    "bad block size": (None, quantization(weight_block_size=[128]), "weight_block_size [128]"),
    "missing scale": (lambda t: t.pop(SCALE), None, f"{WEIGHT} is float8 but the checkpoint has no {SCALE}"),
    "mis-shaped scale": (lambda t: t.update({SCALE: torch.ones(2, 2)}), None,
                         f"{SCALE} has shape [2, 2]; {WEIGHT} [64, 160] in 128x128 blocks needs [1, 2]"),
    "scale without weight": (lambda t: t.update({"model.layers.0.mlp.gate.weight_scale_inv": torch.ones(1, 2)}), None,
                             "model.layers.0.mlp.gate.weight_scale_inv has no weight model.layers.0.mlp.gate.weight"),
    "scale of a 16-bit weight": (lambda t: t.update({"model.embed_tokens.weight_scale_inv": torch.ones(1, 2)}), None,
                                 "model.embed_tokens.weight_scale_inv scales model.embed_tokens.weight, which is F32"),
    "no quantization_config": (None, lambda c: c.pop("quantization_config"),
                               "is stored as float8 (F8_E4M3) but config.json has no quantization_config"),
    "kv scale of two values": (lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.ones(2)}), None,
                               "model.layers.1.self_attn.k_scale has 2 values"),
    "4-bit compressed-tensors": (None, lambda c: c.update(quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}),
        "compressed-tensors format 'pack-quantized' is not supported"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_with_one_line(fp8_dir, tmp_path, case):
    tensors, config, message = CASES[case]
    directory = edited(fp8_dir, tmp_path, tensors, config)
    problem = checkpoint_problem(str(directory))
    assert problem is not None and message in problem and "\n" not in problem


def test_the_load_raises_the_same_error(fp8_dir, tmp_path):
    """Loading checks what it reads too (a checkpoint that changed after the check, or a load without it)."""
    from pipeline.loading import load_model
    from tests.engine_utils import config_for

    tensors, _, message = CASES["mis-shaped scale"]
    directory = edited(fp8_dir, tmp_path, tensors)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_model(config_for(directory))


def test_good_checkpoint_passes(fp8_dir):
    assert checkpoint_problem(str(fp8_dir)) is None


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_exits_with_one_line_before_binding(fp8_dir, tmp_path, command):
    directory = edited(fp8_dir, tmp_path, *CASES["missing scale"][:2])
    args = [sys.executable, "-m", "cli", command, "--model", str(directory), "--device", "cpu"]
    if command == "serve":
        args += ["--port", "1"]  # a port it could not bind: the refusal comes first
    else:
        args += ["--prompt", "hi"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [f"conveyor: error: {WEIGHT} is float8 but the checkpoint has no {SCALE}"], done.stderr
    assert done.stdout == ""


def test_schemes_read_from_config():
    from pipeline.models.quantization import checkpoint_scheme

    per_tensor = checkpoint_scheme({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}})
    assert (per_tensor.strategy, per_tensor.scale_suffix, per_tensor.block_for((6, 10))) == ("tensor", "weight_scale",
                                                                                            (6, 10))
    group = {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
                         "symmetric": True, "dynamic": False}, "input_activations": {"dynamic": True}}
    block = checkpoint_scheme({"quantization_config": {"quant_method": "compressed-tensors",
                                                       "format": "float-quantized", "config_groups": {"g": group}}})
    assert (block.strategy, block.block, block.scale_suffix) == ("block", (128, 128), "weight_scale")
    nested = checkpoint_scheme({"model_type": "qwen3_5_moe", "text_config": {"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}}})
    assert nested.block == (128, 128) and nested.unquantized == ("lm_head",)
    channel = {**group, "weights": {**group["weights"], "strategy": "channel"}}
    with pytest.raises(CheckpointError, match="different weight schemes"):
        checkpoint_scheme({"quantization_config": {"quant_method": "compressed-tensors",
                                                   "config_groups": {"a": group, "b": channel}}})
    assert checkpoint_scheme({"model_type": "llama"}) is None
