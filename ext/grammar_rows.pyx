# cython: language_level=3
"""A decode step's grammar bookkeeping in one pass, compiled. Twin: ext/grammar_rows_py.py (it says
what this does and why; equal results, tests/ext/test_grammar_rows.py)."""


def plan_step(list grammar_rows, list host, type state_type, round_type):
    cdef list states = [], tokens = [], fills = []
    cdef Py_ssize_t taken, position, previous, i
    cdef tuple item
    for item in grammar_rows:
        state = item[1]
        if not isinstance(state, state_type):
            return None
        taken = state.taken
        position = item[3]
        if taken >= position or state.ended:
            continue
        if position - taken > 1:
            return None
        previous = item[2]
        if previous >= 0 and taken == position - 1:
            token = host[previous]
        else:
            recorded = state.recorded
            if taken < len(recorded):
                token = recorded[taken]
            else:
                return None
        states.append(state)
        tokens.append(token)
    for i in range(len(states)):
        state = states[i]
        state.taken += 1
        state.ended = tokens[i] in state.stop_ids
    for item in grammar_rows:
        if not item[1].ended:
            fills.append((item[0], item[1]))
    return (round_type(states, tokens) if states else None), fills
