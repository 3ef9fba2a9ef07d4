"""FP8 KV cache: K and V stored as float8_e4m3fn with one power-of-two scale per layer,
per K or V, and per KV head (`engine.kv_cache_dtype: fp8_e4m3`).

Contract (x (T, H, Dh) in bf16 / fp16 / fp32; scale, inv (H,) fp32 with inv = 1 / scale):
    quantize_kv(x, inv)          -> q (T, H, Dh) float8_e4m3fn
        q = rne_e4m3(clamp(float(x) * inv[h], -448, 448))
    dequantize_kv(q, scale, dt)  -> float(q) * scale[h], cast to dt
    fake_quant_kv(x, scale, inv) =  dequantize_kv(quantize_kv(x, inv), scale, x.dtype)
        (the trainer's K and V: the values the engine's kernels load from the fp8 cache);
        its gradient is straight-through: d fake_quant / dx = identity.
Steps of a quantization: 1. x to fp32 (exact); 2. times inv, a power of two (exact:
no rounding); 3. saturate: |values| beyond 448, e4m3's largest finite, become +-448
(e4m3fn has no infinity; an overflow never turns into NaN); 4. round to nearest-even
e4m3 (3 mantissa bits, subnormals below 2^-6 in steps of 2^-9). A dequantization is
exact: an e4m3 value times a power of two is representable in fp32 and bf16 (and in fp16
for scales in its range), so `fake_quant_kv` rounds once, at step 4, on both sides.

Scaling rule (`scales_from_amax`): scale = 2^ceil(log2(amax * margin / 448)) per layer,
K or V and KV head, amax the largest |K| (after norm and RoPE, as cached) or |V| the
engine's calibration forward saw over the rollout's prompts, margin `KV_SCALE_MARGIN`:
prompt amax lands in (1/4, 1/2] of the range, so generated tokens 2x larger always fit
(up to 4x, by the power of two's rounding); beyond, they saturate (step 3). A head that saw nothing (amax 0) keeps scale 1.
Powers of two keep steps 2 and the dequantization exact; in floating-point fp8 the scale
only places the range (relative precision is 2^-4 throughout the normal range), so a
power of two costs at most a factor 2 of headroom. The scales are fixed for a rollout
phase: the engine calibrates them when the weights changed since its last calibration,
before any K/V is cached, and the trainer's forwards use the same tensors (`KVQuant`, held
by the model), so engine and trainer quantize K and V identically (docs/numerics.md,
"FP8 KV cache").

The Triton half (`triton_fp8.to_e4m3`) is the store kernels' step 1-4 (the KV store and
the fused q/k norm + RoPE + KV store); the attention kernels dequantize each K/V tile on
load (`rlfuse.kernels.attention`). The references here are the spec and the CPU path.
Tests: `python -m pytest -q tests/test_kernel_kv_fp8.py`.
"""

from __future__ import annotations

import dataclasses

import torch

from rlfuse.kernels.backend import resolve_backend, triton_ops

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
KV_SCALE_MARGIN = 2.0  # calibrated amax x this, rounded up to a power of two, maps to 448 (module docstring)
_MAX_EXP = 24  # scales kept in [2^-24, 2^24]: far beyond any K/V seen, and every product exact in fp32
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
"""`EngineConfig.kv_cache_dtype` values: "auto" = the model's dtype."""


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def scales_from_amax(amax: torch.Tensor, margin: float = KV_SCALE_MARGIN) -> torch.Tensor:
    """amax (...) fp32 >= 0 -> power-of-two scales (...) fp32 (module docstring's rule):
    the smallest 2^e with amax * margin / 2^e <= 448; 1 where amax is 0 or not finite."""
    x = amax.float() * margin / FP8_MAX
    ok = torch.isfinite(x) & (x > 0)
    m, e = torch.frexp(torch.where(ok, x, torch.ones_like(x)))  # x = m 2^e, m in [0.5, 1)
    e = torch.where(m == 0.5, e - 1, e).clamp(-_MAX_EXP, _MAX_EXP)  # x a power of two: 2^(e-1) itself
    e = torch.where(ok, e, torch.zeros_like(e))
    return torch.ldexp(torch.ones_like(x), e)


def _per_head(s: torch.Tensor, x: torch.Tensor, who: str) -> torch.Tensor:
    if x.dim() != 3 or s.shape != (x.shape[1],):
        raise ValueError(f"{who}: x must be (T, H, Dh) and the scales (H,), got {tuple(x.shape)} and "
                         f"{tuple(s.shape)}")
    return s.float()[None, :, None]


def quantize_kv_ref(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Steps 1-4 of the module docstring: (T, H, Dh) -> float8_e4m3fn (torch casts round to
    nearest-even; the clamp makes the saturation explicit)."""
    return (x.float() * _per_head(inv, x, "quantize_kv")).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_kv(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Public op (module docstring): the Triton kernel or the reference, the same bits."""
    _per_head(inv, x, "quantize_kv")
    if resolve_backend("quantize_kv", x) == "triton":
        return triton_ops("kv_quant.triton_fp8").quantize_kv_triton(x, inv)
    return quantize_kv_ref(x, inv)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn (T, H, Dh) -> float(q) * scale[h] in `dtype` (exact, module docstring)."""
    return (q.float() * _per_head(scale, q, "dequantize_kv")).to(dtype)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, inv):
        return dequantize_kv(quantize_kv_ref(x, inv), scale, x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None, None  # straight-through (module docstring)


def fake_quant_kv(x: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """x (T, H, Dh) -> the values an fp8 cache gives back for it, in x.dtype. Elementwise
    torch ops on every backend: each element is rounded once, by the cast to fp8, whose
    nearest-even rounding the Triton store reproduces bit for bit (tested), so no Triton
    kernel is needed for the bits; autograd passes the gradient straight through."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _FakeQuant.apply(x, scale, inv)
    return dequantize_kv(quantize_kv_ref(x, inv), scale, x.dtype)


@dataclasses.dataclass(eq=False)
class KVQuant:
    """The fp8 KV scales of one model: scale[l, 0] (K) and scale[l, 1] (V), (Hkv,) each, for
    layer l (rows of layers without attention stay 1). The engine owns the tensors and
    rewrites them in place (`finish_calibration`), so CUDA graphs that captured them stay
    valid; the model holds the object (`CausalLM.kv_quant`), so its packed forwards (the
    trainer's) fake-quantize K and V with the same scales the engine's cache uses.
    While `amax` is set (a calibration forward) forwards record max |K|, |V| per head and
    quantize nothing."""
    scale: torch.Tensor                # (L, 2, Hkv) fp32, powers of two
    inv: torch.Tensor                  # (L, 2, Hkv) fp32, 1 / scale (exact)
    amax: torch.Tensor | None = None   # (L, 2, Hkv) fp32 while calibrating

    @classmethod
    def unit(cls, num_layers: int, num_kv_heads: int, device=None) -> "KVQuant":
        ones = torch.ones((num_layers, 2, num_kv_heads), dtype=torch.float32, device=device)
        return cls(ones, ones.clone())

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, inv) of layer idx, (2, Hkv) each (row 0: K, row 1: V): the kernels' `kv_scale`."""
        return self.scale[idx], self.inv[idx]

    def apply(self, idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed forward's K, V (T, Hkv, Dh) of layer idx: recorded (calibrating) or fake-quantized."""
        if self.amax is not None:
            with torch.no_grad():
                for i, x in enumerate((k, v)):
                    if x.shape[0]:
                        torch.maximum(self.amax[idx, i], x.detach().abs().amax(dim=(0, 2)).float(),
                                      out=self.amax[idx, i])
            return k, v
        s, inv = self.layer(idx)
        return fake_quant_kv(k, s[0], inv[0]), fake_quant_kv(v, s[1], inv[1])

    def start_calibration(self) -> None:
        self.amax = torch.zeros_like(self.scale)

    def finish_calibration(self, margin: float = KV_SCALE_MARGIN) -> torch.Tensor:
        """Set the scales from the recorded amax (in place); returns the amax."""
        amax, self.amax = self.amax, None
        if amax is None:
            raise RuntimeError("KVQuant.finish_calibration without start_calibration")
        s = scales_from_amax(amax, margin)
        self.scale.copy_(s)
        self.inv.copy_(1.0 / s)  # exact: powers of two
        return amax
