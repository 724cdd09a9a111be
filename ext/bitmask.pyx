# cython: language_level=3, boundscheck=False, wraparound=False
"""Assembling a step's grammar bitmask over the batch, compiled. Twin: ext/bitmask_py.py."""
import torch
cimport numpy as cnp
from libc.string cimport memset

cnp.import_array()


def fill_batch_bitmask(cnp.ndarray[cnp.int32_t, ndim=2] bitmask, list rows, fill):
    if not bitmask.flags.c_contiguous:
        raise ValueError("the bitmask buffer must be C-contiguous")
    cdef void *data = <void *>bitmask.data
    cdef size_t size = bitmask.shape[0] * bitmask.shape[1] * sizeof(cnp.int32_t)
    with nogil:  # a batch of 256 rows is 1.5 MB: the event loop runs meanwhile
        memset(data, 0xFF, size)
    if rows:
        fill(torch.from_numpy(bitmask), rows)
