"""``kernels.dispatch.rows_as_decode``: the switch that makes verify rows compute as one-token decode rows."""

from __future__ import annotations

import asyncio

import torch

from kernels import dispatch


def test_the_switch_is_scoped_and_reaches_the_gemvs(monkeypatch):
    seen = []
    monkeypatch.setattr(dispatch, "gemv_triton",
                        lambda x, w, b=None, *, row_loop=False, out_dtype=None: seen.append(row_loop))
    monkeypatch.setattr(dispatch, "gemv_norm_triton", lambda *args, row_loop=False: seen.append(row_loop))
    x, w = torch.zeros(3, 8), torch.zeros(4, 8)
    assert not dispatch.decode_rows_on()
    dispatch.skinny_linear(x, w)
    with dispatch.rows_as_decode():
        assert dispatch.decode_rows_on()
        dispatch.skinny_linear(x, w)
        dispatch.norm_linear(x, None, torch.ones(8), 1e-6, w, None, False)
        with dispatch.rows_as_decode(False):
            dispatch.skinny_linear(x, w)
    dispatch.skinny_linear(x, w)
    assert seen == [False, True, True, False, False]


def test_the_switch_does_not_leak_into_other_tasks():
    async def main() -> list[bool]:
        async def other() -> bool:
            return dispatch.decode_rows_on()

        with dispatch.rows_as_decode():
            task = asyncio.ensure_future(other())  # copies the context now: on
        later = asyncio.ensure_future(other())  # after: off
        return [await task, await later]

    assert asyncio.run(main()) == [True, False]


def test_the_gdn_conv_hears_of_it(monkeypatch):
    """Verify rows of a hybrid model's conv: one-token launches of the decode kernel under the switch (the
    interpreter's sums agree between the conv kernels, so the kernel tests cannot tell; this checks the flag)."""
    import kernels.gdn as gdn
    import kernels.triton_gdn_conv as conv

    seen = []
    monkeypatch.setattr(dispatch, "use_triton", lambda device: True)
    monkeypatch.setattr(conv, "causal_conv1d_varlen_triton", lambda *a, **kw: seen.append(kw["as_decode_rows"]))
    args = (torch.zeros(4, 8), torch.zeros(8, 4), None, torch.zeros(3, 8, 3), torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 4], dtype=torch.int32), torch.ones(1, dtype=torch.bool))
    gdn.causal_conv1d_varlen(*args, max_query_len=4)
    with dispatch.rows_as_decode():
        gdn.causal_conv1d_varlen(*args, max_query_len=4)
    assert seen == [False, True]
