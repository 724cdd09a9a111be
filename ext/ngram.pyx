# cython: boundscheck=False, wraparound=False, cdivision=True
"""The n-gram (prompt lookup) drafter's search, compiled. Twin: ext/ngram_py.py (same algorithm, same results;
tests/ext/test_ngram.py proves it)."""


def propose(const long long[::1] tokens, Py_ssize_t length, int k, int min_n, int max_n):
    """Up to ``k`` drafts for the history ``tokens[:length]`` (empty: no suffix of min_n..max_n tokens recurs)."""
    cdef Py_ssize_t end, best_end = -1, stop
    cdef int matched, best_len = 0
    cdef long long last
    if k <= 0 or min_n < 1 or max_n < min_n or length < min_n + 1 or length > tokens.shape[0]:
        if length > tokens.shape[0]:
            raise ValueError(f"length {length} is past the {tokens.shape[0]} tokens given")
        return []
    last = tokens[length - 1]
    with nogil:
        end = length - 2
        while end >= 0:
            if tokens[end] == last:
                matched = 1
                while matched < max_n and end - matched >= 0 and tokens[end - matched] == tokens[length - 1 - matched]:
                    matched += 1
                if matched > best_len:
                    best_len = matched
                    best_end = end
                    if matched == max_n:
                        break
            end -= 1
    if best_len < min_n:
        return []
    stop = best_end + 1 + k
    if stop > length:
        stop = length
    return [tokens[end] for end in range(best_end + 1, stop)]
