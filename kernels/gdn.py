"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): torch references over a varlen batch with state slots.

A step holds B sequences, their tokens concatenated (``query_start_loc [B+1]``: sequence b owns tokens
``qsl[b]:qsl[b+1]``). Each sequence owns a state slot (``state_slots [B]``) in two per-layer pools:

* ``conv_states [num_slots, C, K-1]`` (model dtype): the last K-1 inputs of the causal depthwise conv;
* ``ssm_states [num_slots, HV, Dk, Dv]`` (fp32): the delta-rule state ``S`` (keys x values).

``has_initial_state [B]`` is False for a sequence whose chunk starts at position 0: its old slot contents are
ignored (zeros), so a reused or recomputed slot never needs clearing. Every function reads the state of its
slots, computes, and writes the state after the chunk's last token back in place. Slot 0 is the null slot:
CUDA-graph padding rows point at it, and its contents are never read as anyone's state.

``keep_slots [T]`` (optional, int, one entry per token): token t's sequence's state as it stands right after token t
is also written to slot ``keep_slots[t]`` (-1: nowhere). A speculative verify row of K+1 tokens so leaves the state
after each of its tokens in spare slots, and a rejected draft rolls back by copying the kept state, not by
recomputing. Keep slots must differ from each other and from every row's own slot (nothing orders their writes
against the reads of those); rows with keep slots hold at most ``RECURRENT_MAX_QUERY`` tokens.

The gates come raw, as the layer's projection gives them: ``a, b [T, HV]`` (model dtype; the kernels take
row-strided column views of the projection) and the per-head ``A_log, dt_bias [HV]`` (fp32). ``gdn_gates`` is
the definition, transformers' to the rounding:

    g_t = -exp(A_log) * softplus(a_t + dt_bias)  (fp32, softplus's threshold 20);   beta_t = sigmoid(b_t)  (b's dtype)

The recurrence per value head h (k head ``h // (HV // HK)``), token t, q/k l2-normalised, q scaled by Dk^-0.5:

    S = exp(g_t) * S;   u_t = beta_t * (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T q_t

The chunked form used for prompts: within a chunk with cumulative log-decay G (``G_t = sum_{j<=t} g_j``) and
state S0 at its start, the updates U solve the unit lower-triangular system
``(I + A) U = beta * (V - exp(G) K S0)`` with ``A_tj = beta_t exp(G_t - G_j) k_t.k_j`` (j < t); then
``o_t = exp(G_t) S0^T q_t + sum_{j<=t} exp(G_t - G_j) (q_t.k_j) u_j`` and
``S_end = exp(G_end) S0 + sum_j exp(G_end - G_j) k_j u_j^T``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import dispatch

CHUNK = 64  # tokens per chunk of the chunked reference (any size gives the same result up to rounding)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g fp32 [T, HV] = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) in b's dtype): the reference
    for the gates that the Triton delta-rule kernels compute in-kernel."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def _check_varlen(query_start_loc: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                  num_tokens: int) -> tuple[list[int], list[int], list[bool]]:
    qsl = [int(v) for v in query_start_loc.tolist()]
    slots = [int(v) for v in state_slots.tolist()]
    init = [bool(v) for v in has_initial_state.tolist()]
    if not (len(qsl) == len(slots) + 1 == len(init) + 1) or qsl[0] != 0 or qsl[-1] != num_tokens:
        raise ValueError(f"query_start_loc {qsl} does not cover {num_tokens} tokens of {len(slots)} sequences")
    return qsl, slots, init


def _check_keep(keep_slots: torch.Tensor | None, num_tokens: int) -> list[int] | None:
    if keep_slots is None:
        return None
    if keep_slots.shape != (num_tokens,):
        raise ValueError(f"keep_slots {tuple(keep_slots.shape)} must hold one slot for each of {num_tokens} tokens")
    return [int(v) for v in keep_slots.tolist()]


def causal_conv1d_varlen_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
    state_slots: torch.Tensor, query_start_loc: torch.Tensor, has_initial_state: torch.Tensor,
    activation: str | None = "silu", keep_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv over each sequence's [previous K-1 inputs, its tokens]: x [T, C], weight [C, K],
    bias [C] or None -> y [T, C] in x's dtype (computed in fp32, then the activation). Writes each slot's last
    K-1 inputs (older ones from its previous state when the chunk is shorter than K-1); with ``keep_slots``, the
    window after token t (the same K-1 inputs, ending at t) to ``conv_states[keep_slots[t]]`` as well."""
    T, C = x.shape
    K = weight.shape[1]
    qsl, slots, init = _check_varlen(query_start_loc, state_slots, has_initial_state, T)
    keep = _check_keep(keep_slots, T)
    y = torch.empty_like(x)
    w = weight.float()
    for b, slot in enumerate(slots):
        lo, hi = qsl[b], qsl[b + 1]
        prev = conv_states[slot] if init[b] else torch.zeros(C, K - 1, dtype=conv_states.dtype, device=x.device)
        seq = torch.cat([prev.to(x.dtype), x[lo:hi].t()], dim=1)  # [C, K-1+L], inputs in x's dtype
        out = F.conv1d(seq.float().unsqueeze(0), w.unsqueeze(1), None if bias is None else bias.float(),
                       groups=C)[0]  # [C, L]
        if activation == "silu":
            out = F.silu(out)
        elif activation is not None:
            raise ValueError(f"activation {activation!r} is not supported")
        y[lo:hi] = out.t().to(x.dtype)
        if keep is not None and K > 1:
            for i in range(hi - lo):  # token lo + i is input K-1+i of seq: its window ends there
                if keep[lo + i] >= 0:
                    conv_states[keep[lo + i]] = seq[:, i + 1:i + K].to(conv_states.dtype)
        conv_states[slot] = seq[:, -(K - 1):].to(conv_states.dtype) if K > 1 else conv_states[slot]
    return y


def _recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k [L, HV, Dk], v [L, HV, Dv], g, beta [L, HV] (all fp32, q scaled), S [HV, Dk, Dv]
    (a batch dim in front of each works too: [N, ...])."""
    out = torch.empty_like(v)
    for t in range(v.shape[-3]):
        S = S * g[..., t, :].exp()[..., None, None]
        kv_mem = (S * k[..., t, :, :, None]).sum(dim=-2)
        u = (v[..., t, :, :] - kv_mem) * beta[..., t, :, None]
        S = S + k[..., t, :, :, None] * u[..., None, :]
        out[..., t, :, :] = (S * q[..., t, :, :, None]).sum(dim=-2)
    return out, S


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             S: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form (module docstring); same arguments as ``_recurrent`` without the batch dim."""
    L = v.shape[0]
    out = torch.empty_like(v)
    for lo in range(0, L, chunk):
        hi = min(lo + chunk, L)
        qc, kc, vc = (t[lo:hi].transpose(0, 1) for t in (q, k, v))  # [HV, n, D]
        G = g[lo:hi].t().cumsum(dim=-1)  # [HV, n]
        bc = beta[lo:hi].t()  # [HV, n]
        n = hi - lo
        causal = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [HV, n, n]
        eG = G.exp()[..., None]
        A = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
        eye = torch.eye(n, dtype=v.dtype, device=v.device)
        rhs = bc[..., None] * (vc - eG * (kc @ S))
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        out[lo:hi] = (eG * (qc @ S) + ((qc @ kc.transpose(1, 2)) * decay) @ U).transpose(0, 1)
        tail = (G[:, -1:] - G).exp()[..., None]  # [HV, n, 1]
        S = G[:, -1].exp()[:, None, None] * S + (kc * tail).transpose(1, 2) @ U
    return out, S


def gated_delta_rule_varlen_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, ssm_states: torch.Tensor, state_slots: torch.Tensor, query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor, use_qk_l2norm: bool = True, chunk: int = CHUNK,
    keep_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k [T, HK, Dk], v [T, HV, Dv], the raw gate inputs a, b [T, HV] and A_log, dt_bias [HV] (module
    docstring) -> o [T, HV, Dv] in v's dtype; math in fp32. Reads and writes ``ssm_states[state_slots[b]]``
    ([HV, Dk, Dv], fp32). Single-token sequences take the recurrent step (batched over them), longer ones the
    chunked form, except those with a keep slot: they go token by token, so that the state after each token
    exists to be kept (``ssm_states[keep_slots[t]]``)."""
    T, HK, Dk = q.shape
    HV = v.shape[1]
    if HV % HK:
        raise ValueError(f"{HV} value heads are not a multiple of {HK} key heads")
    qsl, slots, init = _check_varlen(query_start_loc, state_slots, has_initial_state, T)
    keep = _check_keep(keep_slots, T)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * Dk**-0.5
    if HV != HK:
        qf = qf.repeat_interleave(HV // HK, dim=1)
        kf = kf.repeat_interleave(HV // HK, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(T, HV, v.shape[2], dtype=torch.float32, device=v.device)

    def initial(i: int) -> torch.Tensor:
        return ssm_states[slots[i]].float() if init[i] else torch.zeros_like(ssm_states[slots[i]], dtype=torch.float32)

    singles = [i for i in range(len(slots)) if qsl[i + 1] - qsl[i] == 1]
    if singles:  # decode rows: one batched step
        idx = torch.tensor([qsl[i] for i in singles], device=v.device)
        S = torch.stack([initial(i) for i in singles])
        o, S = _recurrent(qf[idx, None], kf[idx, None], vf[idx, None], gf[idx, None], bf[idx, None], S)
        out[idx] = o[:, 0]
        for n, i in enumerate(singles):
            ssm_states[slots[i]] = S[n].to(ssm_states.dtype)
            if keep is not None and keep[qsl[i]] >= 0:
                ssm_states[keep[qsl[i]]] = S[n].to(ssm_states.dtype)
    for i in range(len(slots)):
        lo, hi = qsl[i], qsl[i + 1]
        if hi - lo <= 1:
            continue
        if keep is not None and any(s >= 0 for s in keep[lo:hi]):
            S = initial(i)
            for t in range(lo, hi):
                o, S = _recurrent(qf[t:t + 1], kf[t:t + 1], vf[t:t + 1], gf[t:t + 1], bf[t:t + 1], S)
                out[t] = o[0]
                if keep[t] >= 0:
                    ssm_states[keep[t]] = S.to(ssm_states.dtype)
        else:
            o, S = _chunked(qf[lo:hi], kf[lo:hi], vf[lo:hi], gf[lo:hi], bf[lo:hi], initial(i), chunk)
            out[lo:hi] = o
        ssm_states[slots[i]] = S.to(ssm_states.dtype)
    return out.to(v.dtype)


def rms_norm_gated_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNormGated: normalise x in fp32, round to x's dtype, times weight, times silu(z) in fp32,
    cast back. x, z [N, D], weight [D]."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * normed) * F.silu(z.float())).to(dtype)


# ---- the entry points the layer calls: Triton on CUDA (kernels/triton_gdn.py), the references elsewhere ----

RECURRENT_MAX_QUERY = 16  # rows up to this many tokens (decode, speculative verify) take the recurrent kernel


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                         state_slots: torch.Tensor, query_start_loc: torch.Tensor,
                         has_initial_state: torch.Tensor, max_query_len: int | None = None,
                         keep_slots: torch.Tensor | None = None) -> torch.Tensor:
    """``causal_conv1d_varlen_ref`` with SiLU; one Triton kernel on the GPU (the decode kernel when
    ``max_query_len`` is 1), which also writes the windows of ``keep_slots`` (module docstring)."""
    if dispatch.use_triton(x.device):
        from kernels.triton_gdn_conv import causal_conv1d_varlen_triton

        return causal_conv1d_varlen_triton(x, weight, bias, conv_states, state_slots, query_start_loc,
                                           has_initial_state, "silu", max_query_len=max_query_len,
                                           keep_slots=keep_slots, as_decode_rows=dispatch.decode_rows_on())
    return causal_conv1d_varlen_ref(x, weight, bias, conv_states, state_slots, query_start_loc, has_initial_state,
                                    keep_slots=keep_slots)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor, state_slots: torch.Tensor,
                     query_start_loc: torch.Tensor, has_initial_state: torch.Tensor, max_query_len: int,
                     query_start_loc_host: list[int] | None = None,
                     gated_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                     keep_slots: torch.Tensor | None = None) -> torch.Tensor:
    """``gated_delta_rule_varlen_ref`` (q/k l2-normalised) on the raw gate inputs. On the GPU both kernels compute
    the gates themselves (no torch op before them): steps whose rows hold at most RECURRENT_MAX_QUERY tokens take
    the token-by-token kernel (CUDA-graph capturable: it reads the row bounds on the device); longer prompt chunks
    take the chunked kernels, which size their grids from the host copy. ``gated_norm`` ``(z [T, HV, Dv], weight,
    eps)``: o is ``rms_norm_gated`` per value head, inside the token-by-token kernel (one launch, not two).
    ``keep_slots [T]`` (module docstring): the token-by-token kernel writes them; a step that also holds longer
    rows (a prompt chunk beside verify rows) runs its short rows through it and the long ones chunked."""
    gpu = dispatch.use_triton(q.device)
    if gpu and keep_slots is not None and max_query_len > RECURRENT_MAX_QUERY and query_start_loc_host is not None:
        return _short_and_long_rows(q, k, v, a, b, A_log, dt_bias, ssm_states, state_slots, has_initial_state,
                                    query_start_loc_host, gated_norm, keep_slots)
    if gpu and (max_query_len <= RECURRENT_MAX_QUERY or query_start_loc_host is None):
        from kernels.triton_gdn import gated_delta_rule_recurrent_triton

        return gated_delta_rule_recurrent_triton(q, k, v, a, b, A_log, dt_bias, ssm_states, state_slots,
                                                 query_start_loc, has_initial_state, gated_norm=gated_norm,
                                                 keep_slots=keep_slots)
    if dispatch.use_triton(q.device):
        from kernels.triton_gdn import gated_delta_rule_chunked_triton

        o = gated_delta_rule_chunked_triton(q, k, v, a, b, A_log, dt_bias, ssm_states, state_slots, query_start_loc,
                                            has_initial_state, query_start_loc_host=query_start_loc_host)
    else:
        o = gated_delta_rule_varlen_ref(q, k, v, a, b, A_log, dt_bias, ssm_states, state_slots, query_start_loc,
                                        has_initial_state, keep_slots=keep_slots)
    if gated_norm is None:
        return o
    z, weight, eps = gated_norm
    T, HV, Dv = o.shape
    return rms_norm_gated(o.reshape(T * HV, Dv), z.reshape(T * HV, Dv), weight, eps).view(T, HV, Dv)


def _short_and_long_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor,
                         state_slots: torch.Tensor, has_initial_state: torch.Tensor, qsl: list[int],
                         gated_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
                         keep_slots: torch.Tensor) -> torch.Tensor:
    """``gated_delta_rule`` of a step mixing rows that keep states with longer ones (an eager step): each group of
    rows gathered and run by the kernel that suits it, the outputs scattered back."""
    lengths = [hi - lo for lo, hi in zip(qsl, qsl[1:])]
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for short in (True, False):
        rows = [i for i, n in enumerate(lengths) if (n <= RECURRENT_MAX_QUERY) == short]
        if not rows:
            continue
        tokens = torch.tensor([t for i in rows for t in range(qsl[i], qsl[i + 1])], device=q.device)
        bounds = [0]
        for i in rows:
            bounds.append(bounds[-1] + lengths[i])
        picked = torch.tensor(rows, device=q.device)

        def part(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, tokens)

        norm = None if gated_norm is None else (part(gated_norm[0]), gated_norm[1], gated_norm[2])
        o.index_copy_(0, tokens, gated_delta_rule(
            part(q), part(k), part(v), part(a), part(b), A_log, dt_bias, ssm_states,
            state_slots.index_select(0, picked),
            torch.tensor(bounds, dtype=torch.int32, device=q.device), has_initial_state.index_select(0, picked),
            max(lengths[i] for i in rows), bounds, norm, part(keep_slots) if short else None))
    return o


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if dispatch.use_triton(x.device):
        from kernels.triton_gdn import rms_norm_gated_triton

        return rms_norm_gated_triton(x, z, weight, eps)
    return rms_norm_gated_ref(x, z, weight, eps)
