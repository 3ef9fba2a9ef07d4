"""How often the rollout's routing differs from the trainer's (`moe/routing_mismatch`), and
what that does to the log-probs: fast vs exact numerics on a random MoE model of a real
layer shape, bf16 (issue 36: offer routing replay only if fast numerics' mismatch makes
training unstable).

The engine generates (its decode CUDA graphs, record_routing on), then the trainer's packed
forward teacher-forces the same tokens; per numerics the script prints the fraction of
(sampled token, MoE layer) pairs whose top-k set differs, the fraction of tokens with at
least one differing layer, and the log-prob mismatch over all tokens and over the tokens
whose routing differs (max |d|, mean |d|, max ratio exp|d|). Exact numerics must read 0.

Shapes (`--arch`): qwen3_moe -- Qwen3-30B-A3B's layer (D 2048, 32 q / 4 kv heads of 128,
128 experts of width 768, top-8) in --layers layers (default 8); qwen3_5_moe -- Qwen3.5-35B-A3B's
(256 experts of width 512, top-8, a shared expert of 512; Gated DeltaNet layers 3 of 4).
Weights N(0, 0.02), the routers N(0, --router-std) (wider: sharper choices).

Run on the GPU box:  OUT=./out python benchmarks/bench_routing_mismatch.py [--arch qwen3_5_moe]
CPU smoke test (tiny shapes, torch kernels, no numbers to keep):
                     python benchmarks/bench_routing_mismatch.py --small
Writes $OUT/routing_mismatch_<arch>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.moe import routing_mismatch
from rlfuse.model import CausalLM, ModelConfig, Packed
from rlfuse.model.arch.qwen3_5_moe import tiny_hybrid_moe_fields
from rlfuse.model.layers.moe import moe_blocks

ATTN = dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            max_position_embeddings=4096, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=8, norm_topk_prob=True)


def config(arch: str, layers: int, small: bool) -> ModelConfig:
    if arch == "qwen3_moe":
        f = dict(ATTN, model_type="qwen3_moe", intermediate_size=6144, num_hidden_layers=layers,
                 moe=dict(MOE, num_experts=128, moe_intermediate_size=768))
        if small:
            f |= dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, moe=dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                                       moe_intermediate_size=32))
        return ModelConfig(**f)
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers))
    if small:
        return ModelConfig(**tiny_hybrid_moe_fields(layer_types=types, num_hidden_layers=layers))
    return ModelConfig(**tiny_hybrid_moe_fields(
        **{k: v for k, v in ATTN.items() if k != "head_dim"}, head_dim=256, num_attention_heads=16,
        num_key_value_heads=2, partial_rotary_factor=0.25, layer_types=types, num_hidden_layers=layers,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        moe=dict(MOE, num_experts=256, moe_intermediate_size=512, shared_expert_intermediate_size=512)))


def build(cfg: ModelConfig, device, dtype, router_std: float, seed: int = 0) -> CausalLM:
    with torch.device(device):
        m = CausalLM(cfg)
    m.init_weights(std=0.02, generator=torch.Generator(device=device).manual_seed(seed))
    with torch.no_grad():
        for b in moe_blocks(m):
            b.gate.weight.normal_(0.0, router_std, generator=torch.Generator(device=device).manual_seed(seed + 1))
    return m.to(dtype).eval()


def measure(model, prompts, numerics: str, max_tokens: int, device) -> dict:
    llm = LLM(model, None, EngineConfig(max_model_len=max(map(len, prompts)) + max_tokens + 16,
                                        max_num_seqs=len(prompts), numerics=numerics, record_routing=True))
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True))
    gen_s = time.perf_counter() - t
    pairs = frac_sum = tokens_off = n_tok = 0
    d_all, d_off = [], []
    blocks = moe_blocks(model)
    for c in outs:
        ids = c.prompt_token_ids + c.output_token_ids
        P, n = len(c.prompt_token_ids), len(c.output_token_ids)
        with use_numerics(numerics), torch.no_grad():  # the trainer's packed forward
            h = model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device),
                      Packed.from_lengths([len(ids)], device=device))
            lp = model.token_logprobs(h[P - 1:P - 1 + n], torch.tensor(ids[P:], device=device), 1.0).float()
        ours = torch.stack([b.last_experts[P - 1:P - 1 + n] for b in blocks], 1)  # (n, L, k)
        theirs = c.routing.to(device).long()
        L = len(blocks)
        frac = routing_mismatch(ours.reshape(n * L, -1), theirs.reshape(n * L, -1))
        frac_sum += float(frac) * n * L
        pairs += n * L
        off = (ours.sort(-1).values != theirs.sort(-1).values).any(-1).any(-1)  # (n,): a layer's set differs
        d = (lp - c.logprobs.to(device).float()).abs()
        d_all.append(d)
        d_off.append(d[off])
        tokens_off += int(off.sum())
        n_tok += n
    d_all = torch.cat(d_all)
    d_off = torch.cat(d_off) if d_off else torch.zeros(0, device=device)
    return {"numerics": numerics, "routing_mismatch": frac_sum / pairs, "tokens": n_tok,
            "tokens_with_a_flip": tokens_off,
            "logprob_max_abs": float(d_all.max()), "logprob_mean_abs": float(d_all.mean()),
            "ratio_max": float(d_all.max().exp()),
            "flipped_logprob_mean_abs": float(d_off.mean()) if d_off.numel() else 0.0,
            "generate_s": gen_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=("qwen3_moe", "qwen3_5_moe"), default="qwen3_moe")
    p.add_argument("--layers", type=int, default=None, help="default 8 (--small: 4)")
    p.add_argument("--prompts", type=int, default=None, help="default 64 (--small: 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 256 (--small: 8)")
    p.add_argument("--router-std", type=float, default=0.02)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default bf16 (--small: fp32)")
    p.add_argument("--small", action="store_true", help="CPU smoke test: tiny shapes, torch kernels")
    args = p.parse_args()
    device = torch.device("cpu" if args.small else "cuda")
    dtype = getattr(torch, args.dtype or ("float32" if args.small else "bfloat16"))
    for k, big, small in (("layers", 8, 4), ("prompts", 64, 4), ("max_tokens", 256, 8)):
        if getattr(args, k) is None:
            setattr(args, k, small if args.small else big)
    model = build(config(args.arch, args.layers, args.small), device, dtype, args.router_std)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (int(torch.randint(16, 128, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    rows = []
    with use_backend("torch" if args.small else "auto"):
        for numerics in ("fast", "exact"):
            rows.append(measure(model, prompts, numerics, args.max_tokens, device))
            print(json.dumps(rows[-1]), flush=True)
    result = {"arch": args.arch, "layers": args.layers, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "router_std": args.router_std, "dtype": str(dtype),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "commit": os.environ.get("RLFUSE_COMMIT", ""), "rows": rows}
    print("| numerics | routing mismatch | tokens | log-prob max abs | mean abs | max ratio | mean abs, flipped |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['numerics']} | {r['routing_mismatch']:.2e} | {r['tokens']} | {r['logprob_max_abs']:.3g} | "
              f"{r['logprob_mean_abs']:.3g} | {r['ratio_max']:.3g} | {r['flipped_logprob_mean_abs']:.3g} |")
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"routing_mismatch_{args.arch}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
