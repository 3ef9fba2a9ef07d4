"""Layer-wise drift probe: where do the rollout and training forwards part ways?

For one token (its sequence and output position) the probe runs the model twice with
forward hooks on every op of every layer, and compares the hook outputs at that token:
  rollout path  the engine's kind of forward: the prompt prefilled into a paged KV cache,
                then one decode step per completion token (M = 1), the last one captured;
  training path the trainer's packed varlen forward of the whole prompt + completion with
                autograd recording, the row that predicts the token captured.
It reports the first (layer, op) whose output differs and the max |delta| of each
layer's output (the residual stream), which `rlfuse check` plots for exact and fast
numerics. The replay is a single-sequence decode: it shows where the two kinds of
forward diverge, not the exact batch the rollout ran in.
"""

from __future__ import annotations

import dataclasses

import matplotlib
import torch

from rlfuse.kernels.backend import use_numerics
from rlfuse.kernels.kv_quant import FP8_DTYPE
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.model import CausalLM, Packed, PagedKV

# q_norm / k_norm are not modules the forward calls: their weights go to the fused
# qk_norm_rope kernel, whose result shows in self_attn.attention
_OPS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.attention", "self_attn.o_proj", "post_attention_layernorm",
        "mlp.gate_proj", "mlp.up_proj", "mlp.swiglu", "mlp.down_proj", "output")
# a sparse MoE layer's feed-forward ops: its router logits (recorded by the block's forward,
# which runs the router GEMM itself), then the block's output
_MOE_MLP_OPS = ("mlp.router_logits", "mlp")


def _layer_ops(layer) -> tuple[str, ...]:
    """The ops hooked in `layer`: _OPS, with a sparse block's ops in place of the dense MLP's."""
    if hasattr(layer.mlp, "down_proj"):
        return _OPS
    return (*[op for op in _OPS if not op.startswith("mlp.") and op != "output"], *_MOE_MLP_OPS, "output")


@dataclasses.dataclass(slots=True)
class DriftReport:
    numerics: str
    ops: list[tuple[int, str, float]]
    """(layer, op, max |delta| at the token) in forward order; layer -1: embedding, L: final norm."""
    layer_max_abs: list[float]
    """max |delta| of each layer's output."""
    logprob_delta: float

    @property
    def first_divergence(self) -> tuple[int, str] | None:
        for layer, op, d in self.ops:
            if d != 0.0:
                return layer, op
        return None


def _capture(model: CausalLM, row: int) -> tuple[dict, list]:
    """Forward hooks storing each op's output row `row` (fp32, detached)."""
    got: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []

    def save(key, pre=False):
        def hook(_mod, args, out=None):
            t = args[0] if pre else out
            if isinstance(t, tuple):
                # a layer's (h, delta): the stream is h + delta (the bits the next norm's
                # fused add computes); a norm's (h + x, y): its output y
                t = t[0] + t[1] if key[1] == "output" else t[1]
            got[key] = t[row].detach().float().clone()
        return hook

    hooks.append(model.model.embed_tokens.register_forward_hook(save((-1, "embed_tokens"))))
    for i, layer in enumerate(model.model.layers):
        for op in _layer_ops(layer):
            if op == "output":
                hooks.append(layer.register_forward_hook(save((i, op))))
            elif op == "self_attn.attention":  # the attention core's output is o_proj's input
                hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(save((i, op), pre=True)))
            elif op == "mlp.router_logits":
                hooks.append(layer.mlp.register_forward_hook(
                    lambda mod, _args, _out, key=(i, op): got.__setitem__(
                        key, mod.last_router_logits[row].detach().float().clone())))
            elif op == "mlp":
                hooks.append(layer.mlp.register_forward_hook(save((i, op))))
            elif op == "mlp.swiglu":
                hooks.append(layer.mlp.down_proj.register_forward_pre_hook(save((i, op), pre=True)))
            else:
                parent, name = op.split(".") if "." in op else ("", op)
                hooks.append(getattr(layer.get_submodule(parent), name).register_forward_hook(save((i, op))))
    hooks.append(model.model.norm.register_forward_hook(save((len(model.model.layers), "norm"))))
    return got, hooks


def _rollout_path(model: CausalLM, ids: list[int], n_prompt: int, upto: int, block_size: int = 16):
    """Prefill ids[:n_prompt] into a fresh paged cache, decode ids[n_prompt:upto] one token at
    a time; returns the hidden state of the last decode step (1, D) and the captured ops."""
    cfg = model.config
    dev, dt = model.lm_head_weight.device, model.lm_head_weight.dtype
    if model.kv_quant is not None:  # the last engine cached K/V in fp8: the replay does too
        dt = FP8_DTYPE
    n_blocks = -(-upto // block_size) + 1
    kv = [(torch.zeros(n_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype=dt, device=dev),
           torch.zeros(n_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype=dt, device=dev))
          for _ in range(cfg.num_hidden_layers)]
    table = torch.arange(n_blocks, dtype=torch.int32, device=dev)[None, :]

    def step(start, end, capture):
        t = torch.arange(start, end, device=dev)
        attn = PagedKV(kv, t.to(torch.int64), torch.tensor([0, end - start], dtype=torch.int32, device=dev),
                       torch.tensor([end], dtype=torch.int32, device=dev), table, end - start)
        got, hooks = _capture(model, end - start - 1) if capture else ({}, [])
        try:
            h = model(torch.tensor(ids[start:end], device=dev), t, attn)
        finally:
            for hk in hooks:
                hk.remove()
        return h[-1:], got

    last = upto - 1  # the row that predicts token `upto`... computed at position upto - 1
    h, got = step(0, n_prompt, capture=n_prompt - 1 == last)
    for p in range(n_prompt, last + 1):
        h, got = step(p, p + 1, capture=p == last)
    return h, got


def layer_drift(model: CausalLM, prompt: list[int], completion: list[int], position: int, *, numerics: str,
                temperature: float = 1.0) -> DriftReport:
    """Compare the two forwards at completion token `position` (0-based) under `numerics`."""
    ids = prompt + completion
    upto = len(prompt) + position  # the token ids[upto] is predicted from row upto - 1
    dev = model.lm_head_weight.device
    W = model.lm_head_weight
    target = torch.tensor([ids[upto]], device=dev)
    with use_numerics(numerics):
        with torch.no_grad():
            h_roll, roll = _rollout_path(model, ids, len(prompt), upto)
            lp_roll = token_logprobs(h_roll, W, target, temperature)
        got, hooks = _capture(model, upto - 1)
        try:
            h = model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev),
                      Packed.from_lengths([len(ids)], dev))
        finally:
            for hk in hooks:
                hk.remove()
        lp_train = token_logprobs(h[upto - 1:upto], W, target, temperature).detach()
    ops = [(layer, op, float((roll[(layer, op)] - t).abs().max()))
           for (layer, op), t in got.items() if (layer, op) in roll]
    n_layers = len(model.model.layers)
    layer_max = [float((roll[(i, "output")] - got[(i, "output")]).abs().max()) for i in range(n_layers)]
    return DriftReport(numerics=numerics, ops=ops, layer_max_abs=layer_max,
                       logprob_delta=float((lp_train - lp_roll).abs().max()))


def plot_layer_drift(reports: list[DriftReport], path) -> None:
    """PNG: max |delta| of each layer's output, one line per numerics (0 drawn at the axis floor)."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pyplot after choosing the headless backend

    fig, ax = plt.subplots(figsize=(7, 4))
    floor = 1e-12
    for r in reports:
        ys = [max(v, floor) for v in r.layer_max_abs]
        first = r.first_divergence
        label = f"{r.numerics}: " + (f"first divergence layer {first[0]} {first[1]}" if first else "bitwise equal")
        ax.plot(range(len(ys)), ys, marker="o", label=label)
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 2)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("max |rollout - training| of the layer output")
    ax.set_title(f"Layer-wise drift at one token (points at {floor:g} are exactly 0)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
