# cython: language_level=3, boundscheck=False, wraparound=False
"""One decode step's rows of the detokenize stage, the common row (a plain next token) done in C and every
other row handed to the stage's general path, compiled. Twin: ext/detokenize_rows_py.py (it says what the
common row is and why; equal results, tests/ext/test_detokenize_rows.py)."""


def detokenize_rows(list requests not None, list indices not None, list finish not None, list tokens not None,
                    list output_counts not None, dict samples not None, list out not None, general, delta_type):
    # rows past a short list are the general path's (to raise on): indexing below skips bounds checks
    cdef Py_ssize_t r, covered = min(len(indices), len(finish), len(tokens), len(output_counts))
    for r in range(len(requests)):
        if r >= covered or not _push_common(requests[r], r, indices, finish, tokens, output_counts, samples, out,
                                            delta_type):
            general(r)


cdef bint _push_common(request, Py_ssize_t r, list indices, list finish, list tokens, list output_counts,
                       dict samples, list out, delta_type) except -1:
    if finish[r] is not None:
        return False
    index = indices[r]
    request_id = request.request_id
    state = samples.get((request_id, index))
    if state is None or state.done or state.stops is not None:
        return False
    token = tokens[r]
    if not (token >= 0) or request.params.logprobs is not None:
        return False
    text = state.detokenizer.push_one(token)
    out.append((request, delta_type(request_id, index, text, [token], None, None, None,
                                    len(request.prompt_token_ids), output_counts[r], request.prompt_opens_thinking)))
    return True
