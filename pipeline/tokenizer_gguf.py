"""Rebuilding a `tokenizers.Tokenizer` from GGUF metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary, merges, token types and the name of
llama.cpp's pre-tokenizer (`tokenizer.ggml.pre`). We assemble the equivalent fast tokenizer so
that a GGUF model tokenizes exactly like its original HF tokenizer, without transformers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from pipeline.models.gguf_file import metadata_value

logger = logging.getLogger(__name__)

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Split patterns of llama.cpp's BPE pre-tokenizer families (the same ones the original
# tokenizer.json files use). The GPT-2 pattern itself is ByteLevel's built-in regex.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_FAMILY = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx", "pixtral"})
_QWEN2_FAMILY = frozenset({"qwen2", "deepseek-r1-qwen"})
_GPT2_FAMILY = frozenset({"gpt2", "default"})


@dataclass(slots=True)
class GGUFTokenizerParts:
    """What the GGUF says about its tokenizer, ready for `pipeline.tokenizer.Tokenizer`."""

    backend: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def byte_level_pre_tokenizer(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(pre-tokenizer, ignore_merges) for llama.cpp's `tokenizer.ggml.pre` name."""
    if pre == "smollm":
        # SmolLM splits every digit on its own before the GPT-2 split.
        sequence = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        return pre_tokenizers.Sequence(sequence), False
    if pre in _LLAMA3_FAMILY or pre in _QWEN2_FAMILY:
        pattern = _LLAMA3_PATTERN if pre in _LLAMA3_FAMILY else _QWEN2_PATTERN
        sequence = [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
        # Llama 3 looks whole words up in the vocabulary before merging (llama.cpp does too).
        return pre_tokenizers.Sequence(sequence), pre in _LLAMA3_FAMILY
    if pre is not None and pre not in _GPT2_FAMILY:
        logger.warning("GGUF pre-tokenizer %r is not known; using the GPT-2 split.", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False), False


def bos_eos_post_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """A post-processor adding BOS and/or EOS around each sequence (nothing when both are None)."""
    prefix = f"{bos[0]}:0 " if bos else ""
    suffix = f" {eos[0]}:0" if eos else ""
    single = f"{prefix}$A:0{suffix}"
    pair = f"{single} {prefix.replace(':0', ':1')}$B:1{suffix.replace(':0', ':1')}"
    specials = list(dict.fromkeys(token for token in (bos, eos) if token is not None))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _register_gguf_added_tokens(backend: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    Either way they must be matched whole in text instead of being cut by BPE. A control token
    spelled outside the byte alphabet is a converter mislabel: it is not in the vocabulary under
    that spelling, so adding it would grow the vocabulary; it is skipped.
    """
    alphabet = set(byte_to_unicode().values())
    special = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_CONTROL and set(token) <= alphabet
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_USER_DEFINED and set(token) <= alphabet
    ]
    if special:
        backend.add_special_tokens(special)
    if user_defined:
        backend.add_tokens(user_defined)


def build_gguf_tokenizer(reader: GGUFReader) -> GGUFTokenizerParts:
    """The fast tokenizer a GGUF describes; only byte-level BPE (`gpt2`) vocabularies are supported."""
    kind = metadata_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is.")
    tokens: list[str] = metadata_value(reader, "tokenizer.ggml.tokens")
    merges: list[str] = metadata_value(reader, "tokenizer.ggml.merges", [])
    token_types: list[int] = metadata_value(reader, "tokenizer.ggml.token_type", [])
    pre = metadata_value(reader, "tokenizer.ggml.pre")

    # Byte-level vocabularies spell every token in the byte alphabet; respell any that are not.
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    pre_tokenizer, ignore_merges = byte_level_pre_tokenizer(pre)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False))
    if pre in _QWEN2_FAMILY:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    _register_gguf_added_tokens(backend, tokens, token_types)

    bos_id = metadata_value(reader, "tokenizer.ggml.bos_token_id")
    eos_id = metadata_value(reader, "tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata_value(reader, "tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    add_eos = bool(metadata_value(reader, "tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    backend.post_processor = bos_eos_post_processor(
        (tokens[bos_id], bos_id) if add_bos else None, (tokens[eos_id], eos_id) if add_eos else None
    )
    return GGUFTokenizerParts(
        backend=backend,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=metadata_value(reader, "tokenizer.chat_template"),
    )
