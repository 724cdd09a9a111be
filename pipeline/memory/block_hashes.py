"""Prefix-cache keys: a chained hash of each full KV block's tokens.

Block i's key hashes block i-1's key with block i's token ids, so equal keys mean equal whole prefixes, not
just equal blocks. The first block's chain starts from the request's cache salt: requests with different salts
(tenants) share no key. blake2b with an 8-byte digest: stable across processes and machines (a disk tier can
keep keys), and at 2**-64 a collision between two live prefixes is not a practical concern.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_root(salt: str | None) -> bytes:
    """The key the first block's hash continues from."""
    return hashlib.blake2b(b"conveyor-prefix:" + (salt or "").encode(), digest_size=8).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, full_blocks: int,
                        salt: str | None) -> list[bytes]:
    """Append to ``hashes`` (the keys of the first len(hashes) blocks of ``token_ids``) the keys of the blocks up
    to ``full_blocks``; returns ``hashes``."""
    previous = hashes[-1] if hashes else chain_root(salt)
    for i in range(len(hashes), full_blocks):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        hashes.append(previous)
    return hashes


def partial_block_key(previous: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a block's first tokens, not a full block (a preempted sequence's last block, swapped to host):
    apart from every full block's key, so no other prompt takes it as a prefix."""
    return hashlib.blake2b(b"partial:" + previous + array("q", token_ids).tobytes(), digest_size=8).digest()
