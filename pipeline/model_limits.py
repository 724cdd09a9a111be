"""What a loaded model allows a request: its length, vocabulary, stop ids, sampling defaults and chat template.

Loading (pipeline/loading.py) fills it once; the intake stage checks every request against it. It lives apart from
both so that neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.request import RepetitionDetection
from pipeline.thinking import ThinkingTags

# generation_config.json keys that may supply request defaults (as vLLM reads them)
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(slots=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    eos_token_ids: frozenset[int]
    generation_defaults: dict[str, float]
    chat_template: str | None
    repetition_detection: RepetitionDetection | None = None  # the server's default loop guard
    thinking_tags: ThinkingTags | None = None  # the ids of <think> and </think> in this tokenizer


def generation_defaults(generation_config: dict) -> dict[str, float]:
    return {k: generation_config[k] for k in GENERATION_DEFAULT_KEYS if generation_config.get(k) is not None}
