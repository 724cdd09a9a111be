"""Pure-Python twin of ext/ngram.pyx: the n-gram (prompt lookup) drafter's search.

The drafts for a sequence are the tokens that followed the latest earlier occurrence of its longest suffix of
min_n..max_n tokens: agents and coding clients repeat what is already in the conversation (a file being edited, a
tool's output quoted back), and the continuation of an earlier occurrence is a good guess for what comes next. One
backward scan: every earlier position holding the last token is a candidate end, extended backwards while it keeps
matching the suffix (at most max_n); the longest wins, the latest among equals, and a max_n match stops the scan.
"""
from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], length: int, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` drafts for the history ``tokens[:length]`` (empty: no suffix of min_n..max_n tokens recurs)."""
    if k <= 0 or min_n < 1 or max_n < min_n or length < min_n + 1:
        return []
    last = tokens[length - 1]
    best_len, best_end = 0, -1
    for end in range(length - 2, -1, -1):
        if tokens[end] != last:
            continue
        matched = 1
        while matched < max_n and end - matched >= 0 and tokens[end - matched] == tokens[length - 1 - matched]:
            matched += 1
        if matched > best_len:
            best_len, best_end = matched, end
            if matched == max_n:
                break
    if best_len < min_n:
        return []
    return [int(t) for t in tokens[best_end + 1:min(best_end + 1 + k, length)]]
