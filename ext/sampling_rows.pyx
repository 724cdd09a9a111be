# cython: language_level=3, boundscheck=False, wraparound=False
"""One step's sampling rows read into upload-ready arrays, compiled.
Twin: ext/sampling_rows_py.py (it says what this does and why; equal results,
tests/ext/test_sampling_rows.py).

The common row (greedy or temperature, maybe top-k/top-p/min-p, maybe a grammar) is read and written
in C: its fields go straight into two preallocated buffers (float32 and int64) and its noise key is
uint64 arithmetic. The rare parts (penalties, logit_bias, min_tokens, forced tokens) are the twin's
Python, collected in lists.
"""
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLongMask, PyLong_CheckExact
from libc.stdint cimport int64_t, uint64_t

import numpy as np

from ext.sampling_rows_py import GREEDY_EPS, SamplingRows

cdef double _greedy_eps = GREEDY_EPS
_EMPTY_F32 = np.empty(0, dtype=np.float32)
_EMPTY_I64 = np.empty(0, dtype=np.int64)
_EMPTY_F32.flags.writeable = False  # shared by every batch without a logit_bias etc.
_EMPTY_I64.flags.writeable = False


cdef inline uint64_t _splitmix64(uint64_t x) noexcept nogil:
    x += 0x9E3779B97F4A7C15ULL
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline uint64_t _rng_key(object seed, object counter) except? 0xFFFFFFFFFFFFFFFFULL:
    """rng_key(seed, counter): `x & MASK64` is the value modulo 2**64, as the Mask call gives it."""
    cdef uint64_t s = PyLong_AsUnsignedLongLongMask(seed)
    cdef uint64_t c = PyLong_AsUnsignedLongLongMask(counter)
    return _splitmix64(_splitmix64(s) ^ c)


cdef inline bint _less(object a, object b) except -1:
    """a < b: in C for two ints (as almost always), else Python's comparison."""
    cdef int over_a = 0, over_b = 0
    cdef long long x, y
    if PyLong_CheckExact(a) and PyLong_CheckExact(b):
        x = PyLong_AsLongLongAndOverflow(a, &over_a)
        y = PyLong_AsLongLongAndOverflow(b, &over_b)
        if over_a == 0 and over_b == 0:
            return x < y
    return a < b


cdef inline bint _top_k(object value, long long vocab, long long* k) except -1:
    """Whether `p.top_k or 0` filters (0 < k < vocab), and its k. A non-int goes through int()."""
    cdef int overflow = 0
    if value is None:
        return False
    if not PyLong_CheckExact(value):
        value = int(value)
    k[0] = PyLong_AsLongLongAndOverflow(value, &overflow)
    return overflow == 0 and 0 < k[0] < vocab


cdef inline object _f32(list values):
    return np.asarray(values, dtype=np.float32) if values else _EMPTY_F32


cdef inline object _i64(list values):
    return np.asarray(values, dtype=np.int64) if values else _EMPTY_I64


def gather(list rows not None, long long vocab_size, counts_of):
    cdef Py_ssize_t num_rows = len(rows), i, n_random = 0, n_top_k = 0, n_top_p = 0
    cdef long long vocab = vocab_size, k = 0, top_k_max = 0, sort_k_max = 0
    cdef int64_t logprobs, max_logprobs = -1
    cdef double t, value
    cdef uint64_t key
    cdef bint has_k, any_temperature = False, any_min_p = False, every_top_p_has_k = True

    # Float32 segments of num_rows: temperature, min_p, top_p_all, repetition, presence, frequency,
    # top_p (the first n_top_p). Int64: top_k_all, num_logprobs, random_rows, top_k_rows, top_k,
    # top_p_rows (each its first n), then rng_keys (2 per random row).
    f32 = np.empty(7 * num_rows, dtype=np.float32)
    i64 = np.empty(8 * num_rows, dtype=np.int64)
    cdef float[::1] f32_view = f32
    cdef int64_t[::1] i64_view = i64
    cdef float* temperature = &f32_view[0]
    cdef float* min_p = temperature + num_rows
    cdef float* top_p_all = min_p + num_rows
    cdef float* rep = top_p_all + num_rows
    cdef float* presence = rep + num_rows
    cdef float* frequency = presence + num_rows
    cdef float* top_p = frequency + num_rows
    cdef int64_t* top_k_all = &i64_view[0]
    cdef int64_t* num_logprobs = top_k_all + num_rows
    cdef int64_t* random_rows = num_logprobs + num_rows
    cdef int64_t* top_k_rows = random_rows + num_rows
    cdef int64_t* top_k = top_k_rows + num_rows
    cdef int64_t* top_p_rows = top_k + num_rows
    cdef int64_t* rng_keys = top_p_rows + num_rows

    cdef list seen_rows = [], counted_rows = [], grammar_rows = []
    cdef list bias_rows = [], bias_tokens = [], bias_values = []
    cdef list suppress_rows = [], suppress_tokens = [], forced_rows = [], forced_tokens = []

    for i in range(num_rows):
        row = rows[i]
        p = row.params
        temperature[i] = 1.0
        min_p[i] = 0.0
        top_p_all[i] = 1.0
        rep[i] = 1.0
        presence[i] = 0.0
        frequency[i] = 0.0
        top_k_all[i] = 0
        num_logprobs[i] = -1

        obj = p.temperature
        t = 1.0 if obj is None else <double>obj
        if t >= _greedy_eps:
            temperature[i] = <float>t
            any_temperature |= t != 1.0
            random_rows[n_random] = i
            key = _rng_key(row.seed, row.counter)
            rng_keys[2 * n_random] = <int64_t>(key & 0xFFFFFFFFULL)
            rng_keys[2 * n_random + 1] = <int64_t>(key >> 32)
            n_random += 1
            has_k = _top_k(p.top_k, vocab, &k)
            if has_k:
                top_k_rows[n_top_k] = i
                top_k[n_top_k] = k
                n_top_k += 1
                top_k_all[i] = k
                top_k_max = max(top_k_max, k)
            obj = p.top_p
            if obj is not None:
                value = <double>obj
                if value < 1.0:
                    top_p_rows[n_top_p] = i
                    top_p[n_top_p] = <float>value
                    n_top_p += 1
                    top_p_all[i] = <float>value
                    if has_k:
                        sort_k_max = max(sort_k_max, k)
                    else:
                        every_top_p_has_k = False
            obj = p.min_p
            if obj is not None:
                value = <double>obj
                if value != 0.0:
                    min_p[i] = <float>value
                    any_min_p = True

        obj = p.repetition_penalty
        if obj is not None:
            value = <double>obj
            if value != 1.0:
                rep[i] = <float>value
                seen_rows.append((i, counts_of(row)))
        presence_obj, frequency_obj = p.presence_penalty, p.frequency_penalty
        if presence_obj or frequency_obj:
            presence[i] = <float><double>presence_obj
            frequency[i] = <float><double>frequency_obj
            counted_rows.append((i, counts_of(row)))
        obj = p.logit_bias
        if obj:
            for tok, bias in obj.items():
                if 0 <= int(tok) < vocab:
                    bias_rows.append(i)
                    bias_tokens.append(int(tok))
                    bias_values.append(float(bias))
        obj = row.num_output_tokens
        if obj is None:
            obj = len(row.output_token_ids)
        if _less(obj, p.min_tokens):
            stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | row.eos_token_ids
            for tok in sorted(stops):
                if 0 <= tok < vocab:
                    suppress_rows.append(i)
                    suppress_tokens.append(tok)
        obj = p.logprobs
        if obj is not None:
            logprobs = obj
            num_logprobs[i] = logprobs
            if logprobs >= 0:
                max_logprobs = max(max_logprobs, logprobs)
        obj = row.grammar
        if obj is not None:
            grammar_rows.append((i, obj, row.grammar_previous_row, row.counter))
        obj = row.forced_token
        if obj is not None and 0 <= obj < vocab:
            forced_rows.append(i)
            forced_tokens.append(obj)

    cdef Py_ssize_t n = num_rows
    return SamplingRows(
        f32[0:n],  # temperature
        any_temperature,
        f32[n:2 * n],  # min_p
        any_min_p,
        i64[0:n],  # top_k_all
        f32[2 * n:3 * n],  # top_p_all
        f32[3 * n:4 * n],  # repetition_penalty
        f32[4 * n:5 * n],  # presence_penalty
        f32[5 * n:6 * n],  # frequency_penalty
        i64[2 * n:2 * n + n_random],  # random_rows
        i64[6 * n:6 * n + 2 * n_random],  # rng_keys
        i64[3 * n:3 * n + n_top_k],  # top_k_rows
        i64[4 * n:4 * n + n_top_k],  # top_k
        top_k_max,
        i64[5 * n:5 * n + n_top_p],  # top_p_rows
        f32[6 * n:6 * n + n_top_p],  # top_p
        sort_k_max if n_top_p and every_top_p_has_k else 0,  # top_p_sort_k
        seen_rows,
        counted_rows,
        _i64(bias_rows + bias_tokens),  # bias_index
        _f32(bias_values),
        _i64(suppress_rows + suppress_tokens),  # suppress_index
        grammar_rows,
        _i64(forced_rows + forced_tokens),  # forced_index
        i64[n:2 * n],  # num_logprobs
        None if max_logprobs < 0 else max_logprobs,
    )
