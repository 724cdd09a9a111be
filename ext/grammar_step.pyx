# cython: language_level=3, boundscheck=False, wraparound=False
"""A step's grammar work in one GIL release, compiled. Twin: ext/grammar_step_py.py.

The device thread gives the step's tokens to the matchers (one batched accept) and then fills the
step's bitmask rows (one batched fill). Through xgrammar's Python API these are two calls: the
accept keeps the GIL (the twin, ext/grammar_step_py.py, says why) and the fill releases it and must
win it back from the busy event loop. Here both run in one nogil block, through tvm-ffi's C ABI
(the interface xgrammar's own bindings use), so the device thread holds the GIL only to gather the
matchers' handles, and the event loop runs beside the whole of the step's grammar work.

Built only where tvm-ffi's headers are installed (setup.py); elsewhere ext.load gives the twin.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

import json

import tvm_ffi
from xgrammar.base import _core

cdef extern from "tvm/ffi/c_api.h" nogil:
    ctypedef void* TVMFFIObjectHandle
    ctypedef struct TVMFFIObject:
        uint64_t combined_ref_count
        int32_t type_index
    ctypedef struct DLDataType:
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct DLDevice:
        int device_type
        int32_t device_id
    ctypedef struct DLTensor:
        void* data
        DLDevice device
        int32_t ndim
        DLDataType dtype
        int64_t* shape
        int64_t* strides
        uint64_t byte_offset
    # the two unions of TVMFFIAny are anonymous in C: their members read as the struct's own
    ctypedef struct TVMFFIAny:
        int32_t type_index
        uint32_t zero_padding
        int64_t v_int64
        void* v_ptr
        TVMFFIObject* v_obj
    ctypedef struct TVMFFISeqCell:
        void* data
        int64_t size
    ctypedef struct TVMFFIByteArray:
        const char* data
        size_t size
    ctypedef struct TVMFFIErrorCell:
        TVMFFIByteArray kind
        TVMFFIByteArray message
    int TVMFFIFunctionCall(TVMFFIObjectHandle func, TVMFFIAny* args, int32_t num_args, TVMFFIAny* result)
    int TVMFFIObjectDecRef(TVMFFIObjectHandle obj)
    void TVMFFIErrorMoveFromRaised(TVMFFIObjectHandle* result)
    int kTVMFFINone, kTVMFFIInt, kTVMFFIBool, kTVMFFIDLTensorPtr, kTVMFFIStaticObjectBegin

cdef enum:
    kDLCPU = 1
    kDLInt = 0


# The signatures called below (result type first), as xgrammar's type schemas spell them.
_SIGNATURES = {
    "batch_accept_token": ["ffi.Array", "ffi.Array", "ffi.Array", "bool"],
    "batch_fill_next_token_bitmask": ["None", "xgrammar.tvm_ffi_binding.BatchGrammarMatcher", "ffi.Array", "Any",
                                      "Any", "bool"],
}


def _schema_types(schema: dict) -> list:
    """A function's result type, then its parameters' types, from its type schema: the result and parameters in
    one "args" list, or (later tvm-ffi) a "named_args" object with "return" and "params" lists."""
    if "args" in schema:
        return [arg["type"] for arg in schema["args"]]
    named = schema["named_args"]
    return [arg["type"] for arg in named["return"] + named["params"]]


def _functions() -> tuple:
    """The FFI functions called below, checked against the signatures this module passes; kept
    referenced here, so their handles stay valid."""
    methods = {method.name: method for method in _core.BatchGrammarMatcher.__tvm_ffi_type_info__.methods}
    for name, signature in _SIGNATURES.items():
        schema = json.loads(methods[name].metadata["type_schema"])
        if _schema_types(schema) != signature:
            raise ImportError(f"xgrammar's {name} has another signature: {schema}")
    return (tvm_ffi.get_global_func("ffi.Array"), methods["batch_accept_token"].func,
            methods["batch_fill_next_token_bitmask"].func)


try:
    _FUNCTIONS = _functions()
except (AttributeError, KeyError, TypeError, ValueError) as exc:  # another xgrammar layout: ext.load falls back to the twin
    raise ImportError(f"xgrammar's batch functions were not found: {exc!r}") from exc
cdef void* _make_array = <void*><size_t>_FUNCTIONS[0].__chandle__()
cdef void* _accept = <void*><size_t>_FUNCTIONS[1].__chandle__()
cdef void* _fill = <void*><size_t>_FUNCTIONS[2].__chandle__()


cdef inline void _none(TVMFFIAny* value) noexcept nogil:
    value.type_index = kTVMFFINone
    value.zero_padding = 0
    value.v_int64 = 0


cdef inline void _object(TVMFFIAny* value, void* handle) noexcept nogil:
    value.type_index = (<TVMFFIObject*>handle).type_index
    value.zero_padding = 0
    value.v_ptr = handle


cdef inline void _int(TVMFFIAny* value, int64_t number, int32_t type_index) noexcept nogil:
    value.type_index = type_index
    value.zero_padding = 0
    value.v_int64 = number


cdef inline void _release(TVMFFIAny* value) noexcept nogil:
    if value.type_index >= kTVMFFIStaticObjectBegin and value.v_obj != NULL:
        TVMFFIObjectDecRef(value.v_obj)
    _none(value)


cdef int _array(TVMFFIAny* items, Py_ssize_t n, TVMFFIAny* out) noexcept nogil:
    _none(out)
    return TVMFFIFunctionCall(_make_array, items, <int32_t>n, out)


cdef int _run(TVMFFIAny* accept_items, Py_ssize_t num_accepts, TVMFFIAny* fill_items, Py_ssize_t num_fills,
              void* batch, DLTensor* tensor, int* refused, Py_ssize_t* num_refused) noexcept nogil:
    """accept_items: the matchers, then their tokens; fill_items: the matchers, then their rows."""
    cdef TVMFFIAny matchers, values, result
    cdef TVMFFIAny args[5]
    cdef TVMFFISeqCell* accepted
    cdef TVMFFIAny* flags
    cdef Py_ssize_t i
    cdef int rc = 0
    _none(&matchers)
    _none(&values)
    _none(&result)
    if num_accepts:
        rc = _array(accept_items, num_accepts, &matchers)
        if rc == 0:
            rc = _array(accept_items + num_accepts, num_accepts, &values)
        if rc == 0:
            args[0] = matchers
            args[1] = values
            _int(&args[2], 0, kTVMFFIBool)  # debug_print
            rc = TVMFFIFunctionCall(_accept, args, 3, &result)
        if rc == 0:  # Array<bool>: the object header, then its sequence cell
            accepted = <TVMFFISeqCell*>((<char*>result.v_obj) + sizeof(TVMFFIObject))
            flags = <TVMFFIAny*>accepted.data
            for i in range(accepted.size):
                if flags[i].v_int64 == 0:
                    refused[num_refused[0]] = <int>i
                    num_refused[0] += 1
        _release(&matchers)
        _release(&values)
        _release(&result)
    if rc == 0 and num_fills:
        rc = _array(fill_items, num_fills, &matchers)
        if rc == 0:
            rc = _array(fill_items + num_fills, num_fills, &values)
        if rc == 0:
            _object(&args[0], batch)
            args[1] = matchers
            _none(&args[2])
            args[2].type_index = kTVMFFIDLTensorPtr
            args[2].v_ptr = tensor
            args[3] = values
            _int(&args[4], 0, kTVMFFIBool)
            rc = TVMFFIFunctionCall(_fill, args, 5, &result)
        _release(&matchers)
        _release(&values)
        _release(&result)
    return rc


cdef str _raised_message():
    cdef TVMFFIObjectHandle error = NULL
    cdef TVMFFIErrorCell* cell
    TVMFFIErrorMoveFromRaised(&error)
    if error == NULL:
        return "the grammar call failed"
    cell = <TVMFFIErrorCell*>((<char*>error) + sizeof(TVMFFIObject))
    message = (<bytes>cell.message.data[:cell.message.size]).decode("utf-8", "replace")
    TVMFFIObjectDecRef(error)
    return message


cdef inline void* _handle(object matcher) except NULL:
    return <void*><size_t>matcher._handle.__chandle__()


def accept_and_fill(batch, list accept, list tokens, list fill, int32_t[:, ::1] bitmask, list rows,
                    bint release_gil=True) -> list:
    """accept[i] takes tokens[i]; then fill[i] writes its next-token mask into bitmask row rows[i].
    Returns the indices into `accept` of the matchers that refused their token (they keep their
    state, and their rows are filled from it). Raises RuntimeError when xgrammar does.
    release_gil=False keeps the GIL: for a few rows (microseconds of work) winning it back from a
    busy event loop costs more than the work."""
    cdef Py_ssize_t num_accepts = len(accept), num_fills = len(fill), num_rows = bitmask.shape[0], i
    if len(tokens) != num_accepts or len(rows) != num_fills:
        raise ValueError("accept_and_fill needs one token per accepting matcher and one row per filling matcher")
    for row in rows:
        if not 0 <= row < num_rows:
            raise IndexError(f"grammar row {row} is outside the bitmask's {num_rows} rows")
    cdef TVMFFIAny* items = <TVMFFIAny*>malloc(sizeof(TVMFFIAny) * (2 * num_accepts + 2 * num_fills + 1))
    cdef int* refused = <int*>malloc(sizeof(int) * (num_accepts + 1))
    cdef Py_ssize_t num_refused = 0
    cdef int64_t shape[2]
    cdef DLTensor tensor
    cdef int rc
    cdef void* batch_handle = _handle(batch)
    if items == NULL or refused == NULL:
        free(items)
        free(refused)
        raise MemoryError()
    try:
        for i in range(num_accepts):
            _object(&items[i], _handle(accept[i]))
            _int(&items[num_accepts + i], tokens[i], kTVMFFIInt)
        for i in range(num_fills):
            _object(&items[2 * num_accepts + i], _handle(fill[i]))
            _int(&items[2 * num_accepts + num_fills + i], rows[i], kTVMFFIInt)
        shape[0], shape[1] = bitmask.shape[0], bitmask.shape[1]
        tensor.data = &bitmask[0, 0] if shape[0] and shape[1] else NULL
        tensor.device.device_type, tensor.device.device_id = kDLCPU, 0
        tensor.ndim = 2
        tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = kDLInt, 32, 1
        tensor.shape, tensor.strides, tensor.byte_offset = shape, NULL, 0
        if release_gil:
            with nogil:
                rc = _run(items, num_accepts, items + 2 * num_accepts, num_fills, batch_handle, &tensor,
                          refused, &num_refused)
        else:
            rc = _run(items, num_accepts, items + 2 * num_accepts, num_fills, batch_handle, &tensor,
                      refused, &num_refused)
        if rc != 0:
            raise RuntimeError(_raised_message())
        return [refused[i] for i in range(num_refused)]
    finally:
        free(items)
        free(refused)
