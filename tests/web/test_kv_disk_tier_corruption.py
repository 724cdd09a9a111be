"""The disk tier's checks, end to end through the live server: prompts whose cached blocks the device pool and the
host tier have pushed down to disk come back after their files were damaged in every way that matters. Each bad
file is read, counted (engine stats and /metrics), deleted and its block computed, the answers equal the answers
before the damage, the good files before it are served as hits, and the engine ends idle with nothing leaked."""
from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable

import orjson
import urllib.request

from pipeline.memory.block_hashes import extend_block_hashes
from pipeline.memory.kv_tiers import _FIXED
from tests.pipeline.test_engine_kv_tiers import BLOCK_SIZE, block_bytes
from tests.web.server_utils import LiveServer, metric_value

PROMPT_TOKENS = 25  # six full blocks are looked up, none of them the prompt's last token's
LOOKED_UP = (PROMPT_TOKENS - 1) // BLOCK_SIZE
BAD_BLOCK = 2  # each damaged prompt's blocks before it are good disk hits; the run stops at it


def truncate(path: str, good: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def flip_payload_byte(path: str, good: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte ^ 0x40]))


def wrong_shape(path: str, good: str) -> None:
    """The header's shape field (right after the fixed part) one larger; magic, dtype and checksum intact."""
    with open(path, "r+b") as f:
        f.seek(_FIXED.size)
        size = int.from_bytes(f.read(8), "little")
        f.seek(_FIXED.size)
        f.write((size + 1).to_bytes(8, "little"))


def overwrite_header(path: str, good: str) -> None:
    with open(path, "r+b") as f:
        f.write(b"\0" * 16)


def delete(path: str, good: str) -> None:
    os.remove(path)


def another_blocks_file(path: str, good: str) -> None:
    """A well-formed file of the same tier (the clean prompt's block at the same position) under this name."""
    shutil.copyfile(good, path)


DAMAGE: list[Callable[[str, str], None]] = [truncate, flip_payload_byte, wrong_shape, overwrite_header, delete,
                                            another_blocks_file]
PROMPTS = [[random.Random(70 + i).randrange(100, 49000) for _ in range(PROMPT_TOKENS)] for i in range(1 + len(DAMAGE))]
FILLERS = [[random.Random(90 + i).randrange(100, 49000) for _ in range(60)] for i in range(5)]


def complete(live: LiveServer, prompt: list[int]) -> tuple[str, int]:
    """Greedy completion of a token-id prompt: its text and the prompt tokens the prefix cache held."""
    body = orjson.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    request = urllib.request.Request(live.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        reply = orjson.loads(response.read())
    return reply["choices"][0]["text"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def disk_stats(live: LiveServer) -> dict:
    offload = live.wait_idle()["kv_offload"]
    return {"corrupt": offload["tiers"]["disk"]["corrupt"], "hits": offload["tiers"]["disk"]["hits"],
            "restored": offload["disk_restored_blocks"], "dropped": offload["dropped_blocks"]}


def test_damaged_disk_files_are_recomputed_and_counted_and_good_ones_hit(tiny_model_dir, tmp_path):
    size = block_bytes(tiny_model_dir)
    # a pool of 29 blocks and a host tier of 20 (more than one step evicts): a prompt's blocks reach disk whole
    tiers = dict(num_kv_blocks=30, max_num_seqs=2, kv_offload_host_gib=20 * size / (1 << 30),
                 kv_offload_dir=str(tmp_path), kv_offload_disk_gib=1000 * (size + 256) / (1 << 30))
    with LiveServer(tiny_model_dir, **tiers) as live:
        expected = [complete(live, prompt) for prompt in PROMPTS]
        assert all(cached == 0 for _, cached in expected)
        for filler in FILLERS:
            complete(live, filler)
        before = disk_stats(live)
        assert before == {"corrupt": 0, "hits": 0, "restored": 0, "dropped": 0}
        (directory,) = os.listdir(tmp_path)  # the tier's private directory
        files = [[os.path.join(tmp_path, directory, key.hex())
                  for key in extend_block_hashes([], prompt, BLOCK_SIZE, LOOKED_UP, None)] for prompt in PROMPTS]
        assert all(os.path.isfile(path) for paths in files for path in paths)  # on disk, so in no tier above
        good = files[0][BAD_BLOCK]
        for damage, paths in zip(DAMAGE, files[1:]):
            damage(paths[BAD_BLOCK], good)

        text, cached = complete(live, PROMPTS[0])  # every block comes back from disk
        assert (text, cached) == (expected[0][0], LOOKED_UP * BLOCK_SIZE)
        clean = disk_stats(live)
        assert clean == {"corrupt": 0, "hits": LOOKED_UP, "restored": LOOKED_UP, "dropped": 0}
        for i, (damage, paths) in enumerate(zip(DAMAGE, files[1:]), start=1):
            text, cached = complete(live, PROMPTS[i])
            assert text == expected[i][0], damage.__name__
            assert cached == BAD_BLOCK * BLOCK_SIZE, damage.__name__  # the good blocks before the bad one only
            assert not os.path.exists(paths[BAD_BLOCK]), damage.__name__
            assert disk_stats(live) == {"corrupt": i, "hits": LOOKED_UP + i * BAD_BLOCK,
                                        "restored": LOOKED_UP + i * BAD_BLOCK, "dropped": 0}, damage.__name__

        metrics = live.metrics_text()
        assert metric_value(metrics, "conveyor_kv_offload_disk_corrupt_total") == len(DAMAGE)
        assert metric_value(metrics, "conveyor_kv_offload_disk_restored_blocks_total") == (
            LOOKED_UP + len(DAMAGE) * BAD_BLOCK)
        assert metric_value(metrics, "conveyor_prefix_cache_hits_total") == (
            LOOKED_UP + len(DAMAGE) * BAD_BLOCK) * BLOCK_SIZE

        # the recomputed blocks are cached again: the same answers, and no bad file is left to find
        assert [complete(live, prompt)[0] for prompt in PROMPTS] == [text for text, _ in expected]
        stats = live.wait_idle()
        assert stats["kv_offload"]["tiers"]["disk"]["corrupt"] == len(DAMAGE)
        assert stats["waiting"] == {"requests": 0, "tokens": 0}
