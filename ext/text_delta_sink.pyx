# cython: language_level=3, boundscheck=False, wraparound=False
"""A streamed response's listener, with the common delta's path as one call, compiled.
Twin: ext/text_delta_sink_py.py (it says what the sink does and why; equal results,
tests/ext/test_text_delta_sink.py)."""
from ext.sse_text import text_event_chunk


cdef inline void _observe(histogram, double value, Py_ssize_t times) except *:
    """histogram.observe(value, times) of pipeline.stage.Histogram, inline: its bucket is the first
    bound >= value (bisect_left), the last ("+Inf") past every bound."""
    cdef tuple bounds = histogram.buckets
    cdef Py_ssize_t low = 0, high = len(bounds), middle
    while low < high:
        middle = (low + high) // 2
        if <double>bounds[middle] < value:
            low = middle + 1
        else:
            high = middle
    cdef list counts = histogram.counts
    counts[low] += times
    histogram.total += value * times
    histogram.samples += times


cdef class TextDeltaSink:
    cdef readonly object slow, tracker, write, gaps, clock
    cdef readonly dict templates
    cdef readonly bint count_offset

    def __init__(self, slow, tracker, dict templates not None, write, gaps, clock, bint count_offset):
        self.slow = slow
        self.tracker = tracker
        self.templates = templates
        self.write = write
        self.gaps = gaps
        self.clock = clock
        self.count_offset = count_offset

    def __call__(self, delta):
        if delta.finish_reason is not None or delta.logprobs:
            self.slow(delta)
            return None
        index = delta.index
        tracker = self.tracker
        template = self.templates.get(index)
        choice = tracker.choices.get(index)
        if template is None or choice is None:
            self.slow(delta)
            return None
        cdef Py_ssize_t tokens = len(delta.token_ids)
        if tokens:
            now = self.clock()
            if tracker.first_token is None:
                tracker.first_token = now
            else:
                last = tracker.last_delta
                if last is not None:
                    _observe(self.gaps, (now - last) / tokens, tokens)
            tracker.last_delta = now
        tracker.prompt_tokens = delta.prompt_token_count
        choice.prompt_opens_thinking = delta.prompt_opens_thinking
        count = delta.output_token_count
        if count > choice.output_tokens:
            choice.output_tokens = count
        text = delta.text
        if self.count_offset:
            choice.text_offset += len(text)
        if text:
            self.write(text_event_chunk((<tuple>template)[0], text, (<tuple>template)[1]))
        return None
