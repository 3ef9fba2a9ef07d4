"""The Gated DeltaNet mixer: Qwen3.5's linear-attention layer over packed sequences.

Parameter names and shapes equal transformers' `Qwen3_5GatedDeltaNet` (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a, conv1d.weight (C, 1, W), dt_bias, A_log, norm.weight,
out_proj), so checkpoints map 1:1; `FusedGatedDeltaNet` is Qwen3-Next's (in_proj_qkvz,
in_proj_ba, interleaved per key head), the same mixer past its input projections. The math
lives in `rlfuse.kernels.gated_delta`; this file only wires it (no copy of the delta rule
here). For x (T, D), cu_seqlens (B+1,):

    qkv = silu(causal_conv1d(in_proj_qkv(x)))            (T, 2 Hk Dk + Hv Dv), per sequence
    q, k, v = split(qkv)                                   (T, Hk, Dk), (T, Hk, Dk), (T, Hv, Dv)
    beta = sigmoid(in_proj_b(x))                           (T, Hv)
    g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)     (T, Hv) fp32, the log decay
    o = chunk_gated_delta_rule(q, k, v, g, beta)           (T, Hv, Dv), q/k l2-normed inside
    y = out_proj(gated_rmsnorm(o, z = in_proj_z(x)))       (T, D)

The engine's per-sequence state (`forward_slots` over `PagedKV.linear`, a `LinearSlots`), in
one of two layouts picked by the engine's numerics (`state_shapes`):
  exact: between calls a sequence keeps, per linear-attention layer, `LinearState`: the last
    W-1 conv inputs, S_c (the delta-rule state at its last 64-token chunk boundary, fp32) and
    the kernel inputs (q, k, v, g, beta after the conv) of the < 64 tokens since that
    boundary. `GatedDeltaNet.forward_continue` runs new tokens of a batch of sequences from
    such states: the conv continues from its state, and the kernel runs ONCE over [buffered
    rows + new rows] from S_c, so every row goes through the same chunk arithmetic as in the
    trainer's forward over the whole sequence (gdn_contract: chunks aligned to the
    sequence's first token, the returned state is the one after the last FULL chunk). The
    outputs equal the whole-sequence forward's bitwise (tests/test_qwen3_5.py checks it on
    the references).
  fast: the conv inputs and the running state after the sequence's last token ("recurrent",
    fp32). `forward_recurrent` runs whole 64-row chunks of the new rows through the chunk
    kernel and the rest through the recurrent kernel, which leaves the state after the last
    token; a decode step is one recurrent step, O(Dk Dv) a head instead of a 64-row chunk
    (tests/test_hybrid_fast_decode.py).
`forward_decode` (over a `LinearDecode`) is the step for one token per sequence with fixed
shapes and no host values, which the engine's static decode path captures in CUDA graphs
(tests/test_engine_hybrid.py: static == eager, bitwise in exact numerics; in fast numerics
bitwise on the same rows, tests/test_hybrid_fast_decode.py).

Shape legend: T packed tokens, B sequences, D hidden, Hk/Hv key/value heads, Dk/Dv their
head dims, C conv channels (2 Hk Dk + Hv Dv), W conv width.
Test: python -m pytest -q tests/test_qwen3_5.py tests/test_hybrid_fast_decode.py
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlfuse.kernels.backend import is_exact

# CHUNK: the kernels' chunk length; the engine keeps the state at multiples of it
from rlfuse.kernels.gated_delta import (
                                        CHUNK,
                                        causal_conv1d,
                                        causal_conv1d_update,
                                        chunk_gated_delta_decode,
                                        chunk_gated_delta_rule,
                                        fused_recurrent_gated_delta_rule,
                                        gated_rmsnorm,
                                        gdn_gates,
)
from rlfuse.model.layers.linear import Linear
from rlfuse.model.layers.packed import TAIL, LinearDecode, LinearSlots, Packed, PagedKV

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig


class GatedRMSNorm(nn.Module):
    """HF `Qwen3_5RMSNormGated`: rmsnorm(x) * w * silu(z), weight initialised to ones."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        return gated_rmsnorm(x, z, self.weight, self.eps)


@dataclasses.dataclass(slots=True)
class PrefixRows:
    """A `Packed` batch whose segments read a shared prefix (`Packed.prefix`, GRPO's shared
    prompt), re-laid for linear attention: a reader segment becomes [its prefix's rows, its
    own rows], so the conv and the chunks run over the same logical sequence, from the
    prefix's first token, as the unshared batch (in exact numerics its own rows' outputs are
    bitwise the unshared ones; the prefix's rows are recomputed once per reader and their
    outputs dropped). Attention and every other layer still read the prompt once.
    `gather` is the re-lay with a deterministic backward: a prefix row's gradient sums its
    own copy, then its readers' copies in reader order (no atomics on repeated rows)."""
    rows: torch.Tensor        # (T',) int64 the packed row of each re-laid row
    own: torch.Tensor         # (T,) int64 the re-laid row holding each packed row in its own segment
    cu_seqlens: torch.Tensor  # (B+1,) int32 the re-laid segments
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # per reader rank k: (re-laid rows, packed rows) of
    #                                                   every prefix's k-th reader's copy; packed rows unique

    @classmethod
    def of(cls, attn) -> "PrefixRows":
        # host sync: the layout, once per forward that has a shared prefix (the trainer's micro-batch)
        bounds = attn.cu_seqlens.tolist()
        p_start, p_len = attn.prefix.start.tolist(), attn.prefix.length.tolist()
        rows, own, lens, copies, readers = [], [0] * bounds[-1], [], [], {}
        for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            if p_len[b]:
                k = readers[p_start[b]] = readers.get(p_start[b], -1) + 1
                if k == len(copies):
                    copies.append(([], []))
                copies[k][0].extend(range(len(rows), len(rows) + p_len[b]))
                copies[k][1].extend(range(p_start[b], p_start[b] + p_len[b]))
                rows.extend(range(p_start[b], p_start[b] + p_len[b]))
            own[s:e] = range(len(rows), len(rows) + e - s)
            rows.extend(range(s, e))
            lens.append(p_len[b] + e - s)
        dev = attn.cu_seqlens.device
        t = lambda x: torch.tensor(x, dtype=torch.long).to(dev)  # noqa: E731
        cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32)
        return cls(t(rows), t(own), cu.to(dev), [(t(dst), t(src)) for dst, src in copies])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, ...) packed rows -> (T', ...) re-laid rows."""
        return _ReLay.apply(x, self)


@dataclasses.dataclass(slots=True)
class PackedWithPrefixRows(Packed):
    """A `Packed` with a shared prefix, carrying the linear-attention layers' re-laid rows
    (PrefixRows), computed once per forward instead of once per layer."""
    prefix_rows: PrefixRows | None = None


def _cu(lens: list[int], device) -> torch.Tensor:
    """Sequence lengths -> (B + 1,) int32 offsets of their packed rows."""
    return torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)


def _last_rows(lens: list[int], counts: list[int], device) -> torch.Tensor:
    """Row indices, in a packing of sequences of `lens` rows, of each sequence's last counts[b] rows."""
    idx, start = [], 0
    for n, c in zip(lens, counts):
        idx.extend(range(start + n - c, start + n))
        start += n
    return torch.tensor(idx, device=device, dtype=torch.long)


def prepare_prefix_rows(attn):
    """A hybrid family's `ArchSpec.prepare`: a Packed batch with a shared prefix (GRPO's
    shared prompt) gets the linear-attention layers' re-laid rows (one host sync)."""
    if isinstance(attn, Packed) and attn.prefix is not None and not isinstance(attn, PackedWithPrefixRows):
        return PackedWithPrefixRows(attn.cu_seqlens, attn.max_seqlen, attn.prefix, attn.kv_quant,
                                    prefix_rows=PrefixRows.of(attn))
    return attn


class _ReLay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, re: PrefixRows):
        ctx.re = re
        return x.index_select(0, re.rows)

    @staticmethod
    def backward(ctx, grad):
        re = ctx.re
        dx = grad.index_select(0, re.own)
        for dst, src in re.copies:  # src rows unique within a rank: each index_add_ adds once per row
            dx.index_add_(0, src, grad.index_select(0, dst))
        return dx, None


@dataclasses.dataclass(slots=True)
class LinearState:
    """One linear-attention layer's state for B sequences between calls (see module doc).
    tail_lens[b] < CHUNK rows of `tail` (packed in sequence order) are sequence b's kernel
    inputs since its last chunk boundary; `chunk_state` is the state at that boundary."""
    conv: torch.Tensor         # (B, C, W-1) the last W-1 conv inputs (zeros before the first token)
    chunk_state: torch.Tensor  # (B, Hv, Dk, Dv) fp32 S_c
    tail: tuple[torch.Tensor, ...]  # (q (N, Hk, Dk), k (N, Hk, Dk), v (N, Hv, Dv), g (N, Hv), beta (N, Hv))
    tail_lens: list[int]       # (B,) host ints, sum = N


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.n_k * self.dk, self.n_v * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.width = cfg.linear_conv_kernel_dim
        D = cfg.hidden_size
        self.in_proj_qkv = Linear(D, self.conv_dim, bias=False)
        self.in_proj_z = Linear(D, self.value_dim, bias=False)
        self.in_proj_b = Linear(D, self.n_v, bias=False)
        self.in_proj_a = Linear(D, self.n_v, bias=False)
        # depthwise, no bias (HF's nn.Conv1d, weight (C, 1, W)); its forward is never called:
        # the kernel family's varlen causal conv runs it
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.width, groups=self.conv_dim, bias=False,
                                padding=self.width - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, D, bias=False)
        self.in_proj_fused = None  # the input projections as one GEMM: set by rlfuse.model.fuse (no state)

    # -- the three stages (the trainer runs them in a row; the engine wraps the middle one)
    def project(self, x_TD, cu_seqlens, conv_state=None, rows=None, gates=True):
        """-> (q, k, v, g, beta), z (T, Hv, Dv), conv_state (B, C, W-1): the kernel's inputs
        for the rows of x (or x re-laid by `rows`, a PrefixRows, as `cu_seqlens`), the conv
        continuing from `conv_state` (None: zeros). gates=False: (q, k, v, a, b), the raw
        projections in place of g and beta (the recurrent kernel's `gate_params` prologue)."""
        mixed, z, b, a = self.in_projections(x_TD)  # z: the output side, x's own rows
        if rows is not None:
            mixed, b, a = rows.gather(mixed), rows.gather(b), rows.gather(a)
        qkv, conv_state = causal_conv1d(mixed, self.conv1d.weight.squeeze(1), None, cu_seqlens,
                                        initial_state=conv_state, activation="silu")  # (T, C)
        return self._kernel_inputs(qkv, b, a, gates), z, conv_state

    def in_projections(self, x_TD):
        """x (T, D) -> mixed (T, C) = [q | k | v] (the conv's input), z (T, Hv, Dv), b, a (T, Hv)."""
        mixed, z, b, a = self._project(x_TD, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
        return mixed, z.view(x_TD.shape[0], self.n_v, self.dv), b, a

    def _project(self, x_TD, names):
        """The projections `names` of x: column slices of one GEMM while they are fused
        (`rlfuse.model.fuse`; views, which the kernels take by stride, and backward saves
        every part anyway), else one GEMM each."""
        fused = self.in_proj_fused
        if fused is not None and fused.live(self):
            return fused(x_TD).split(fused.sizes, -1)
        return tuple(getattr(self, n)(x_TD) for n in names)

    def _kernel_inputs(self, qkv, b, a, gates=True):
        """conv output (T, C), b, a (T, Hv) -> (q, k, v, g, beta), the kernel's inputs
        (gates=False: (q, k, v, a, b)). q, k, v are views of qkv (no copies: the kernels
        take their strides)."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], -1)
        q, k, v = q.reshape(T, self.n_k, self.dk), k.reshape(T, self.n_k, self.dk), v.reshape(T, self.n_v, self.dv)
        if not gates:
            return q, k, v, a, b
        # HF's order: beta in the model dtype, g (T, Hv) fp32 from A_log and a in fp32
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        return q, k, v, g, beta

    def output(self, o_THV, z):
        """(T, Hv, Dv) kernel output -> (T, D): gated norm, then out_proj."""
        T = o_THV.shape[0]
        return self.out_proj(self.norm(o_THV, z).reshape(T, self.value_dim))

    def forward(self, x_TD, positions, attn, inv_freq=None, cos_sin=None):
        """The mixer interface (`rlfuse.model.layers.attention`; positions and RoPE unused):
        x (T, D) of packed sequences starting at their first token, attn a `Packed` -> (T, D).
        With a shared prefix, the re-laid rows `attn.prefix_rows` (PrefixRows.of(attn), which
        the model makes once per forward, `prepare_prefix_rows`; made here if absent)."""
        if isinstance(attn, PagedKV):
            if attn.linear is None:
                raise ValueError(f"linear-attention layer {self.layer_idx}: a PagedKV step without the "
                                 f"linear-attention state (PagedKV.linear; the engine's LinearStateCache)")
            if isinstance(attn.linear, LinearDecode):
                return self.forward_decode(x_TD, positions, attn.linear)
            return self.forward_slots(x_TD, attn.linear)
        prefix_rows = getattr(attn, "prefix_rows", None)
        if attn.prefix is None:
            inputs, z, _ = self.project(x_TD, attn.cu_seqlens)
            return self.output(chunk_gated_delta_rule(*inputs, attn.cu_seqlens)[0], z)
        re = prefix_rows if prefix_rows is not None else PrefixRows.of(attn)
        inputs, z, _ = self.project(x_TD, re.cu_seqlens, rows=re)
        o = chunk_gated_delta_rule(*inputs, re.cu_seqlens)[0]  # (T', Hv, Dv)
        return self.output(o.index_select(0, re.own), z)

    def forward_slots(self, x_TD, st: LinearSlots):
        """The engine's step: the sequences' states read from their slots, `forward_continue`
        (exact numerics) or `forward_recurrent` (fast), the states after the step written
        back in place."""
        t = self._engine_state(st.layers)
        conv = t["conv"][st.slots]
        if "recurrent" in t:
            y, conv, t["recurrent"][st.slots] = self.forward_recurrent(x_TD, st.new_lens, conv,
                                                                        t["recurrent"][st.slots])
            t["conv"][st.slots] = conv.to(t["conv"].dtype)
            return y
        state = LinearState(conv, t["chunk"][st.slots], tuple(t[n][st.read_at] for n in TAIL), st.tail_lens)
        y, new = self.forward_continue(x_TD, st.new_lens, state)
        t["conv"][st.slots] = new.conv.to(t["conv"].dtype)
        t["chunk"][st.slots] = new.chunk_state
        for n, rows in zip(TAIL, new.tail):
            t[n][st.write_at] = rows
        return y

    def _engine_state(self, layers: dict) -> dict[str, torch.Tensor]:
        """This layer's engine state, checked against the numerics the step runs in: the
        layouts differ (`state_shapes`), and decoding one layout in the other numerics would
        be silently wrong (exact) or read tensors that are not there (fast)."""
        t = layers[self.layer_idx]
        if ("recurrent" in t) == is_exact():
            have, now = ("fast", "exact") if "recurrent" in t else ("exact", "fast")
            raise ValueError(f"linear-attention layer {self.layer_idx}: the engine's state is laid out for {have} "
                             f"numerics but the step runs in {now} numerics (LinearStateCache(exact=...) must "
                             f"follow EngineConfig.numerics)")
        return t

    def forward_decode(self, x_BD, positions, st: LinearDecode):
        """The static decode step (`LinearDecode`: one token per row, CUDA-graph capturable:
        fixed shapes, no host values). The conv continues from its state (the decode
        update, bitwise the prefill conv's window). Then:
        fast numerics: the recurrent kernel advances each row's running state in place in
        its slot (`fused_recurrent_gated_delta_rule(state_slots=...)`), O(Dk Dv) a head,
        computing the gates from the raw a, b in its prologue (`gate_params`);
        exact numerics: the same arithmetic as `forward_continue` with new_lens = 1: each
        row's chunk [tail, new token] is laid out as a full 64-row chunk whose rows past the
        new token are exact zeros -- the rows the kernel pads a shorter sequence with -- so
        its row at the new token has the eager call's bits; the state after that full chunk
        is kept only when the new token completes the chunk (tail = 63), else S_c stays
        (`chunk_gated_delta_decode`: the tails and S_c read in their slots, S_c written back
        in place)."""
        t, slots = self._engine_state(st.layers), st.slots
        mixed, z, b, a = self.in_projections(x_BD)
        # the conv shifts each row's state in its slot (no gather / scatter); the same
        # arithmetic as on the gathered states, so exact numerics keep their bits
        qkv = causal_conv1d_update(mixed, t["conv"], self.conv1d.weight.squeeze(1), None, activation="silu",
                                   state_slots=slots)
        if "recurrent" in t:  # one token a row (no offsets); the gates from the raw a, b in the kernel's prologue
            o, _ = fused_recurrent_gated_delta_rule(*self._kernel_inputs(qkv, b, a, gates=False), None,
                                                    initial_state=t["recurrent"], state_slots=slots,
                                                    gate_params=(self.A_log, self.dt_bias))
            return self.output(o, z)
        new = self._kernel_inputs(qkv, b, a)
        tail_len = st.index.remainder(CHUNK)                              # (B,) buffered rows before
        for n, x in zip(TAIL, new):
            # the token's row joins its tail in place (the storage dtype is the row's: no rounding;
            # once the chunk completes the tail restarts at row 0, so row 63 is never read again)
            t[n].index_put_((slots, tail_len), x.to(t[n].dtype))
        o = chunk_gated_delta_decode(tuple(t[n] for n in TAIL), t["chunk"], slots, tail_len)  # (B, Hv, Dv)
        return self.output(o, z)

    def state_shapes(self, exact: bool) -> dict[str, tuple[tuple[int, ...], str]]:
        """Per-slot shapes of this layer's engine state and their dtype ("model" or "fp32").
        Both keep the conv inputs; exact numerics S_c ("chunk") and the tail buffer (module
        doc), fast numerics the state after the sequence's last token ("recurrent"), which
        the decode step advances in place: two thirds of exact's bytes at Qwen3.5's shapes."""
        conv = {"conv": ((self.conv_dim, self.width - 1), "model")}
        if not exact:
            return conv | {"recurrent": ((self.n_v, self.dk, self.dv), "fp32")}
        return conv | {"chunk": ((self.n_v, self.dk, self.dv), "fp32"),
                       "q": ((CHUNK, self.n_k, self.dk), "model"), "k": ((CHUNK, self.n_k, self.dk), "model"),
                       "v": ((CHUNK, self.n_v, self.dv), "model"), "g": ((CHUNK, self.n_v), "fp32"),
                       "beta": ((CHUNK, self.n_v), "model")}

    def empty_state(self, batch: int, device, dtype) -> LinearState:
        """The state of B sequences before their first token."""
        z = lambda *s, dt=dtype: torch.zeros(s, device=device, dtype=dt)  # noqa: E731
        return LinearState(z(batch, self.conv_dim, self.width - 1),
                           z(batch, self.n_v, self.dk, self.dv, dt=torch.float32),
                           (z(0, self.n_k, self.dk), z(0, self.n_k, self.dk), z(0, self.n_v, self.dv),
                            z(0, self.n_v, dt=torch.float32), z(0, self.n_v)),
                           [0] * batch)

    def forward_continue(self, x_TD, new_lens: list[int], state: LinearState):
        """New tokens of B sequences (x packed in sequence order, new_lens[b] rows each) from
        their states -> (y (T, D), the states after them). One kernel call over each
        sequence's [buffered rows + new rows] from S_c; the buffered rows' outputs are
        dropped (they were returned by earlier calls), the state after the last full chunk
        becomes S_c and the rows past it the new buffer (see module doc)."""
        device = x_TD.device
        inputs, z, conv = self.project(x_TD, _cu(new_lens, device), state.conv)
        # rows of [tail_b, new_b] for each b, gathered from cat(tail, new)
        n_tail = sum(state.tail_lens)
        idx, keep, t0, n0 = [], [], 0, n_tail
        for lt, ln in zip(state.tail_lens, new_lens):
            keep.extend(range(len(idx) + lt, len(idx) + lt + ln))
            idx.extend(range(t0, t0 + lt))
            idx.extend(range(n0, n0 + ln))
            t0, n0 = t0 + lt, n0 + ln
        idx_t = torch.tensor(idx, device=device, dtype=torch.long)
        rows = [torch.cat((t.to(x.dtype), x)).index_select(0, idx_t) for t, x in zip(state.tail, inputs)]
        lens = [lt + ln for lt, ln in zip(state.tail_lens, new_lens)]
        cu = _cu(lens, device)
        o, chunk_state = chunk_gated_delta_rule(*rows, cu, initial_state=state.chunk_state, output_final_state=True)
        o = o.index_select(0, torch.tensor(keep, device=device, dtype=torch.long))
        # the new buffer: each sequence's rows past its last full chunk
        tail_lens = [n % CHUNK for n in lens]
        tail_idx = _last_rows(lens, tail_lens, device)
        tail = tuple(r.index_select(0, tail_idx) for r in rows)
        return self.output(o, z), LinearState(conv, chunk_state, tail, tail_lens)

    def forward_recurrent(self, x_TD, new_lens: list[int], conv_state, state):
        """Fast numerics: new tokens of B sequences (x packed in sequence order, new_lens[b]
        rows each) from their conv states (B, C, W-1) and running states (B, Hv, Dk, Dv) fp32
        (after each sequence's last token) -> (y (T, D), conv states, running states after the
        new tokens). Whole 64-row chunks of the new rows (from each sequence's first new
        row) go through the chunk kernel; the rows past them through the recurrent kernel
        from the chunk kernel's state, which leaves the state after the last token and gives
        those rows the decode step's arithmetic (a one-token step here is bitwise the static
        decode's on the same rows: the same kernels, the same inputs)."""
        device = x_TD.device
        cu = _cu(new_lens, device)
        # the recurrent kernel's rows get the raw a, b and compute the gates in its prologue,
        # as the static decode step does (so the two stay bitwise equal on the same rows)
        raw, z, conv_state = self.project(x_TD, cu, conv_state, gates=False)  # (q, k, v, a, b)
        gate_params = (self.A_log, self.dt_bias)
        if max(new_lens, default=0) < CHUNK:  # no whole chunk: token by token (every eager decode step)
            o, state = fused_recurrent_gated_delta_rule(*raw, cu, initial_state=state, gate_params=gate_params)
            return self.output(o, z), conv_state, state
        g, beta = gdn_gates(raw[3], raw[4], *gate_params)
        o, state = chunk_gated_delta_rule(*raw[:3], g, beta, cu, initial_state=state, output_final_state=True)
        rest = [n % CHUNK for n in new_lens]
        if any(rest):
            idx_t = _last_rows(new_lens, rest, device)
            o_r, state = fused_recurrent_gated_delta_rule(*(x.index_select(0, idx_t) for x in raw),
                                                          _cu(rest, device), initial_state=state,
                                                          gate_params=gate_params)
            o = o.index_copy(0, idx_t, o_r)
        return self.output(o, z), conv_state, state


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's Gated DeltaNet (`Qwen3NextGatedDeltaNet`): the same mixer with the input
    projections fused as transformers stores them, so checkpoints, LoRA targets and PEFT
    names map 1:1 (in_proj_qkvz (Hk (2 Dk + 2 r Dv), D), in_proj_ba (2 Hv, D), r = Hv / Hk).
    Their output rows are interleaved per key head h:
        qkvz[h] = [q_h (Dk) | k_h (Dk) | v of value heads h r .. h r + r-1 (r Dv) | z of the same (r Dv)]
        ba[h]   = [b of value heads h r .. (r) | a of the same (r)]
    `in_projections` runs the two GEMMs (one where `rlfuse.model.fuse` joined them) and de-interleaves them into
    GatedDeltaNet's [q | k | v], z, b, a by views and one concatenation (a permutation of
    the GEMM's outputs: no arithmetic), so every later step is GatedDeltaNet's."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)  # the shapes and every other parameter; its four projections
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a  # give way to the two fused ones
        D = cfg.hidden_size
        self.in_proj_qkvz = Linear(D, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = Linear(D, 2 * self.n_v, bias=False)

    def in_projections(self, x_TD):
        T, r = x_TD.shape[0], self.n_v // self.n_k
        qkvz, ba = self._project(x_TD, ("in_proj_qkvz", "in_proj_ba"))
        q, k, v, z = qkvz.view(T, self.n_k, -1).split([self.dk, self.dk, r * self.dv, r * self.dv], -1)  # (T, Hk, .)
        mixed = torch.cat((q.reshape(T, self.key_dim), k.reshape(T, self.key_dim), v.reshape(T, self.value_dim)), -1)
        b, a = ba.view(T, self.n_k, 2 * r).split([r, r], -1)  # each (T, Hk, r)
        return mixed, z.reshape(T, self.n_v, self.dv), b.reshape(T, self.n_v), a.reshape(T, self.n_v)
