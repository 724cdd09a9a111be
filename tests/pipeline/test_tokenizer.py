"""Our tokenizer (rebuilt from GGUF metadata, or read from an HF dir) agrees with transformers'."""

from __future__ import annotations

import json
import random
import re
import unicodedata
from typing import Any

import gguf
import pytest

from pipeline.tokenizer import Tokenizer
from pipeline.tokenizer_gguf import byte_to_unicode

CORPUS = [
    "Hello, world! How are you doing today?",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say we've done what's needed, isn't it?",
    "def f(x):\n    if x > 0:\n        return x::int\n\treturn -x\n",
    "std::vector<int> v; v.push_back(42); // C++ :: scope",
    "fn main() {\n    let s = String::from(\"hi\");\n}\n",
    "12345 and 3.14159 and 1,000,000 and 0x1F and v2.0.1",
    "Phone: +1 (555) 010-9999; year 2024",
    "emoji: 😀🚀👍🏽 and flags 🇫🇷 and ZWJ 👨‍👩‍👧",
    "中文测试：你好，世界！日本語のテキスト。한국어 문장.",
    "Ünïcödé àccents, Ελληνικά, русский текст, العربية",
    "    leading spaces",
    "trailing spaces    ",
    "tabs\t\tand\tmore\t",
    "multiple\n\n\nnewlines\r\nwindows\rcarriage",
    "   \n  \n\t \n",
    " ",
    "",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end<repo_name>x<file_sep>y",
    "<|im_start |> not special <|im_end",
    "a" * 300,
    "ĠĊ literal byte-level glyphs Ġ",
]


def random_corpus(count: int, seed: int = 1234) -> list[str]:
    """Deterministic mixed-script strings: catches boundary cases the fixed corpus misses."""
    rng = random.Random(seed)
    pieces = [" ", "  ", "\n", "\t", "7", "42", "x", "Hello", "::", "->", "😀", "中", "é", "\u200b", "<|im_end|>",
              "'s", "'LL", "(", ")", "{}", "ab12cd", " 9", "\r\n", "ß", "🇫🇷", "—", "…"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 25))) for _ in range(count)]


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm_gguf_path: str) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm_gguf_path)


def digit_split_pieces(text: str) -> list[str]:
    """SmolLM's first pre-tokenization step (tokenizers' Digits(individual_digits=True)): every
    numeric character on its own, the stretches between them untouched."""
    pieces: list[str] = []
    for char in text:
        if unicodedata.category(char) in ("Nd", "Nl", "No"):
            pieces.append(char)
        elif pieces and not _is_digit(pieces[-1]):
            pieces[-1] += char
        else:
            pieces.append(char)
    return pieces


def _is_digit(piece: str) -> bool:
    return len(piece) == 1 and unicodedata.category(piece) in ("Nd", "Nl", "No")


# transformers' GGUF loader has no entry for tokenizer.ggml.pre == "smollm" and falls back to the plain
# GPT-2 split, dropping the digit split that SmolLM2's tokenizer.json (and llama.cpp) apply first. The two
# only disagree where two or more whitespace characters directly precede a digit ("x  9": the original
# gives x|ĠĠ|9, transformers' GGUF tokenizer x|Ġ|Ġ|9). We follow the original.
WHITESPACE_RUN_BEFORE_DIGIT = re.compile(r"\s{2,}(?=\d)")


def assert_same_as_reference(ours: Tokenizer, reference: Any, texts: list[str], *, smollm_digits: bool) -> None:
    for text in texts:
        expected = reference.encode(text)
        if smollm_digits:
            # Encoding each digit-split piece on its own gives the original pre-tokenization exactly.
            original = [i for piece in digit_split_pieces(text) for i in reference.encode(piece)]
            assert ours.encode(text) == original, text
            if not WHITESPACE_RUN_BEFORE_DIGIT.search(text):
                assert original == expected, text
            expected = original
        else:
            assert ours.encode(text) == expected, text
        # SmolLM2 adds no special tokens, so there the bare encoding is the same list.
        bare = expected if smollm_digits else reference.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == bare, text
        for skip in (True, False):
            assert ours.decode(expected, skip_special_tokens=skip) == reference.decode(
                expected, skip_special_tokens=skip
            ), (text, skip)


def test_gguf_tokenizer_matches_transformers(gguf_tokenizer: Tokenizer, hf_gguf_tokenizer: Any) -> None:
    texts = CORPUS + random_corpus(300)
    assert_same_as_reference(gguf_tokenizer, hf_gguf_tokenizer, texts, smollm_digits=True)
    # The corpus does exercise both sides of the divergence.
    assert any(WHITESPACE_RUN_BEFORE_DIGIT.search(text) for text in texts)
    assert sum(not WHITESPACE_RUN_BEFORE_DIGIT.search(text) for text in texts) > 250


def test_smollm_digits_split_before_the_gpt2_regex(gguf_tokenizer: Tokenizer, hf_gguf_tokenizer: Any) -> None:
    tokens = [gguf_tokenizer.id_to_token(i) for i in gguf_tokenizer.encode("x  9")]
    assert tokens == ["x", "ĠĠ", "9"]
    assert hf_gguf_tokenizer.convert_ids_to_tokens(hf_gguf_tokenizer.encode("x  9")) == ["x", "Ġ", "Ġ", "9"]


def test_gguf_tokenizer_round_trips_text(gguf_tokenizer: Tokenizer) -> None:
    for text in CORPUS + random_corpus(100, seed=7):
        assert gguf_tokenizer.decode(gguf_tokenizer.encode(text), skip_special_tokens=False) == text


def test_gguf_tokenizer_properties(gguf_tokenizer: Tokenizer, hf_gguf_tokenizer: Any) -> None:
    tok = gguf_tokenizer
    assert tok.vocab_size == len(hf_gguf_tokenizer) == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert (tok.bos_token, tok.eos_token) == (hf_gguf_tokenizer.bos_token, hf_gguf_tokenizer.eos_token)
    assert tok.special_token_ids == frozenset(range(17))  # every control token of the GGUF
    assert tok.chat_template == hf_gguf_tokenizer.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.encode("hi")[0] != tok.bos_token_id  # SmolLM2: add_bos_token is False
    assert tok.token_to_id("<|im_start|>") == 1 and tok.id_to_token(2) == "<|im_end|>"
    # Digits are split one by one (SmolLM's pre-tokenizer).
    assert [tok.id_to_token(i) for i in tok.encode("12345")] == list("12345")


def test_hf_dir_tokenizer_round_trip(tmp_path: Any, gguf_tokenizer: Tokenizer, hf_gguf_tokenizer: Any) -> None:
    hf_gguf_tokenizer.save_pretrained(tmp_path)
    loaded = Tokenizer.from_pretrained(str(tmp_path))
    assert loaded.chat_template == gguf_tokenizer.chat_template
    assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)
    assert loaded.vocab_size == gguf_tokenizer.vocab_size
    assert loaded.special_token_ids == gguf_tokenizer.special_token_ids
    texts = CORPUS + random_corpus(100, seed=99)
    assert_same_as_reference(loaded, hf_gguf_tokenizer, texts, smollm_digits=False)


def _with_tokenizer_json_edit(directory: Any, post_processor: dict[str, Any] | None) -> None:
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["post_processor"] = post_processor
    path.write_text(json.dumps(data), encoding="utf-8")


def _set_tokenizer_config(directory: Any, **values: Any) -> None:
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def test_hf_dir_bos_follows_tokenizer_json_post_processor(tmp_path: Any, hf_gguf_tokenizer: Any) -> None:
    transformers = pytest.importorskip("transformers")
    hf_gguf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    plain = Tokenizer.from_pretrained(str(tmp_path)).encode("hello")

    # A tokenizer.json post-processor that adds BOS is authoritative (a config flag does not override it).
    _with_tokenizer_json_edit(tmp_path, {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    })
    _set_tokenizer_config(tmp_path, add_bos_token=False)
    ours = Tokenizer.from_pretrained(str(tmp_path))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.encode("hello") == reference.encode("hello") == [1, *plain]
    assert ours.encode("hello", add_special_tokens=False) == plain
    assert ours.chat_template is None
    assert_same_as_reference(ours, reference, CORPUS[:6], smollm_digits=False)

    # Without a post-processor the tokenizer_config flags decide.
    _with_tokenizer_json_edit(tmp_path, None)
    _set_tokenizer_config(tmp_path, add_bos_token=True, add_eos_token=True)
    assert Tokenizer.from_pretrained(str(tmp_path)).encode("hello") == [1, *plain, 2]
    _set_tokenizer_config(tmp_path, add_bos_token=False, add_eos_token=False)
    assert Tokenizer.from_pretrained(str(tmp_path)).encode("hello") == plain


def _write_tiny_bpe_gguf(path: str, pre: str) -> None:
    """A byte-level vocabulary: 3 control tokens, 1 user-defined, 256 bytes and a few merges."""
    byte_tokens = list(byte_to_unicode().values())
    merged = ["Ġt", "he", "Ġthe", "12", "Ġw"]
    tokens = ["<s>", "</s>", "<|ctl|>", "<think>", *byte_tokens, *merged]
    types = [3, 3, 3, 4, *([1] * (len(byte_tokens) + len(merged)))]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ t", "h e", "Ġt he", "1 2", "Ġ w"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "smollm", "something-new"])
def test_synthetic_gguf_tokenizer(tmp_path: Any, pre: str) -> None:
    path = str(tmp_path / f"tok-{pre}.gguf")
    _write_tiny_bpe_gguf(path, pre)
    tok = Tokenizer.from_pretrained(path)
    ids = tok.encode("<think> the 1234 w<|ctl|>")
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert 3 in ids and 2 in ids  # user-defined and control tokens stay whole
    assert tok.token_to_id("Ġthe") in ids
    twelve = tok.token_to_id("12")
    assert (twelve in ids) == (pre in ("gpt2", "llama-bpe", "something-new"))  # qwen2/smollm split digits
    assert tok.decode(ids) == "<think> the 1234 w"  # specials skipped, user-defined kept
    assert tok.decode(ids, skip_special_tokens=False) == "<s><think> the 1234 w<|ctl|>"
    assert tok.special_token_ids == frozenset({0, 1, 2})
    assert tok.vocab_size == 4 + 256 + 5
