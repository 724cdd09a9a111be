"""Parser defaults by model family: what `conveyor serve` resolves for a model directory, and explicit flags winning."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli.main import add_serve_parser, server_settings
from pipeline.model_family import NO_DEFAULTS, family_defaults
from web.app import ServerSettings, ServerState
from web.chat_tools import chat_output_parsers
from web.metrics import ServerMetrics

QWEN3_5 = family_defaults({"model_type": "qwen3_5_moe"})


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


@pytest.fixture
def model_dir(tmp_path: Path, tokenizer_files: Path) -> Callable[[dict], str]:
    """A model directory as far as settings resolution looks: config.json plus the SmolLM2 tokenizer, no weights."""
    def make(config: dict) -> str:
        directory = tmp_path / config.get("model_type", "untyped")
        directory.mkdir()
        for item in tokenizer_files.iterdir():
            (directory / item.name).write_bytes(item.read_bytes())
        (directory / "config.json").write_text(json.dumps(config))
        return str(directory)
    return make


def test_qwen3_5_moe_directory_serves_with_qwen3_coder_and_qwen3(model_dir) -> None:
    settings = server_settings(serve_args("--model", model_dir({"model_type": "qwen3_5_moe", "hidden_size": 8})))
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("qwen3_coder", "qwen3")


def test_multimodal_qwen3_5_directory(model_dir) -> None:
    config = {"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"}}
    settings = server_settings(serve_args("--model", model_dir(config)))
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("qwen3_coder", "qwen3")


def test_explicit_flags_win(model_dir) -> None:
    path = model_dir({"model_type": "qwen3_5_moe"})
    settings = server_settings(serve_args("--model", path, "--tool-call-parser", "hermes",
                                          "--reasoning-parser", "deepseek_r1"))
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("hermes", "deepseek_r1")
    off = server_settings(serve_args("--model", path, "--reasoning-parser", "none"))
    assert (off.tool_call_parser, off.reasoning_parser) == ("qwen3_coder", None)


def test_llama_directory_keeps_todays_behaviour(model_dir) -> None:
    path = model_dir({"model_type": "llama"})
    settings = server_settings(serve_args("--model", path))
    assert (settings.tool_call_parser, settings.reasoning_parser) == (None, None)  # None: the template decides
    chosen = server_settings(serve_args("--model", path, "--reasoning-parser", "qwen3"))
    assert (chosen.tool_call_parser, chosen.reasoning_parser) == (None, "qwen3")


def test_unreadable_model_gets_no_defaults(tmp_path: Path) -> None:
    settings = server_settings(serve_args("--model", str(tmp_path / "missing")))
    assert (settings.tool_call_parser, settings.reasoning_parser) == (None, None)


@pytest.mark.parametrize("given,expected", [
    ((None, None), ("qwen3_coder", "qwen3")),
    (("hermes", None), ("hermes", "qwen3")),
    ((None, "deepseek_r1"), ("qwen3_coder", "deepseek_r1")),
    ((None, "none"), ("qwen3_coder", None)),
])
def test_with_model_defaults(given: tuple, expected: tuple) -> None:
    settings = ServerSettings(["m"], tool_call_parser=given[0], reasoning_parser=given[1])
    resolved = settings.with_model_defaults(QWEN3_5)
    assert (resolved.tool_call_parser, resolved.reasoning_parser) == expected
    assert resolved.with_model_defaults(NO_DEFAULTS) == resolved  # resolved settings stay as they are


def test_none_means_no_reasoning_split_even_unresolved() -> None:
    state = ServerState(ServerSettings(["m"], reasoning_parser="none"), ServerMetrics(lambda: {}, "m"))
    request = SimpleNamespace(tools=None, tool_choice="none", chat_template_kwargs={})
    assert chat_output_parsers(state, request) is None
    state.settings.reasoning_parser = "qwen3"
    assert chat_output_parsers(state, request)().reasoning_parser == "qwen3"
