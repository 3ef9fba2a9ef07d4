"""Generation throughput: the engine vs transformers `generate` vs the bandwidth bound.

Model: Qwen3-0.6B-shaped, random weights (hidden 1024, 28 layers, 16 q / 8 kv heads of
128, vocab 151936, tied), bf16; `shape` picks another shape (`SHAPES`: Qwen3 0.6b..8b,
Qwen3.5 3.5-0.8b / 3.5-2b hybrids, the MoE 30b-a3b / 35b-a3b and the unpublished moe-3b).
Cases: `rlfuse.engine.benchmark.cases` (nanovllm, fixed, grpo, decode; all temperature-sampled,
ignore_eos). Bound: `rlfuse.engine.benchmark.bound` (every decode step reads the weights and
each sequence's K/V once, at the copy bandwidth measured in the same run).
Throughput = output tokens / wall time of the whole `generate` (prefill included).
With `kv_cache_dtype: fp8_e4m3` (`--kv-cache-dtype`), % of bound is still against the bound
of a cache in the model's dtype (K/V at 2 bytes): what fp8 buys shows as a % above that
bound's share; `pct_own_bound` is against the 1-byte bound.

Peer (dense shapes): transformers `generate` on the same weights (our state_dict loaded into the HF
model built from `ModelConfig.to_hf()`; a logits check confirms they match) and the same
prompts; the nanovllm case runs in left-padded batches of `peer_batch` to the batch's
longest output (useful tokens only are counted); the engine sleeps meanwhile.
`small=True`: a tiny fp32 model and small cases for a CPU smoke test.
Run: rlfuse bench generate [--small]   or   python benchmarks/bench_generate.py
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from rlfuse.engine.benchmark.bound import _sync, bound_bytes, copy_bandwidth, routed_expert_bytes, state_bytes_per_step
from rlfuse.engine.benchmark.cases import Case, make_cases
from rlfuse.engine.benchmark.shapes import build_model
from rlfuse.engine.cache import kv_layers
from rlfuse.engine.config import EngineConfig, SamplingParams
from rlfuse.engine.llm import LLM
from rlfuse.kernels.backend import new_compiles, triton_compiles
from rlfuse.model import CausalLM

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    small: bool = False
    """Tiny fp32 model and small cases (CPU smoke test)."""
    cases: tuple[str, ...] = ("nanovllm", "fixed", "grpo")
    shape: str = "0.6b"
    """The model: a key of `SHAPES` (random weights)."""
    peer: bool = True
    """Also time transformers generate (skipped with a note when transformers is missing)."""
    peer_batch: int = 128
    peer_max_seqs: int | None = None
    """Time the peer on the first this-many sequences of each case only (tok/s stays comparable)."""
    device: str | None = None
    """Default: cuda if available, else cpu."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    gpu_memory_fraction: float = 0.9
    enforce_eager: bool = False
    seed: int = 0
    numerics: str = "fast"
    """EngineConfig.numerics: exact runs the batch-invariant kernels (docs/numerics.md)."""
    share_prefix_decode: bool | None = None
    """EngineConfig.share_prefix_decode (the grpo case's groups read their prompt once)."""
    kv_cache_dtype: str = "auto"
    """EngineConfig.kv_cache_dtype. The bound stays the model-dtype (bf16) KV cache's, the
    issue-38 target (`pct_bound`); `pct_own_bound` is against the bound with fp8's 1-byte K/V.
    The scales are calibrated once, in the warm-up generate (the weights never change here)."""


def _hf_model(model: CausalLM):
    import transformers

    hf_dict = model.config.to_hf()
    hf_cfg = transformers.AutoConfig.for_model(**hf_dict)
    W = model.lm_head_weight
    with torch.device(W.device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=W.dtype, attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"peer weights do not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.eval()
    ids = torch.randint(0, min(1000, model.config.vocab_size), (1, 32), device=W.device)
    with torch.no_grad():
        ours = model.logits(model.forward_padded(ids))
        theirs = hf(ids).logits.float()
    rel = float((ours - theirs).norm() / ours.norm())
    return hf, rel


@torch.no_grad()
def _peer_generate(hf, case: Case, peer_batch: int, max_seqs: int | None, pad_id: int) -> tuple[int, float]:
    """(useful output tokens, seconds) of transformers generate on the case."""
    items = list(zip(case.prompts, case.params))[:max_seqs]
    dev = next(hf.parameters()).device
    tokens, t0 = 0, time.perf_counter()
    per = max(1, peer_batch // max(p.n for _, p in items))
    for i in range(0, len(items), per):
        chunk = items[i:i + per]
        L = max(len(pr) for pr, _ in chunk)
        ids = torch.full((len(chunk), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), L), dtype=torch.long)
        for r, (pr, _) in enumerate(chunk):
            ids[r, L - len(pr):] = torch.tensor(pr)
            mask[r, L - len(pr):] = 1
        O = max(p.max_tokens for _, p in chunk)
        p0 = chunk[0][1]
        hf.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=True, temperature=p0.temperature,
                    top_k=0, top_p=1.0, max_new_tokens=O, min_new_tokens=O, num_return_sequences=p0.n,
                    pad_token_id=pad_id, eos_token_id=None)
        tokens += sum(p.max_tokens * p.n for _, p in chunk)
    _sync(dev)
    return tokens, time.perf_counter() - t0


def run(cfg: BenchConfig) -> dict:
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bw = copy_bandwidth(device, (64 if cfg.small else 1024) * 2**20)
    model = build_model(cfg.small, device, cfg.seed, cfg.shape)
    mc = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * len(kv_layers(mc)) * mc.num_key_value_heads * mc.head_dim * model.lm_head_weight.element_size()
    state_step = state_bytes_per_step(model)
    experts = routed_expert_bytes(model)  # MoE: a step reads the experts its batch touches
    ecfg = EngineConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                        max_model_len=(128 if cfg.small else 2048), gpu_memory_fraction=cfg.gpu_memory_fraction,
                        enforce_eager=cfg.enforce_eager, seed=cfg.seed, numerics=cfg.numerics,
                        share_prefix_decode=cfg.share_prefix_decode, kv_cache_dtype=cfg.kv_cache_dtype)
    kv_own = kv_per_token // model.lm_head_weight.element_size() if cfg.kv_cache_dtype == "fp8_e4m3" else kv_per_token
    t0 = time.perf_counter()
    llm = LLM(model, None, ecfg)
    llm.capture_graphs()
    init_s = time.perf_counter() - t0
    llm.generate([[1] * 16], SamplingParams(max_tokens=8))  # nano-vllm's one-sequence warm-up
    hf, peer_note = None, ""
    if cfg.peer and mc.is_hybrid:
        peer_note = "no peer on a hybrid shape (transformers' Gated DeltaNet needs flash-linear-attention)"
    elif cfg.peer:
        try:
            import transformers  # noqa: F401
        except ImportError:
            peer_note = "transformers not installed: no peer"
    result = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, dtype=str(model.lm_head_weight.dtype).replace("torch.", ""),
                  copy_bandwidth_GBps=bw / 1e9, weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token,
                  linear_state_bytes_per_seq_step=state_step, shape=cfg.shape,
                  routed_expert_bytes=experts[0] if experts else 0,
                  kv_blocks=llm.kv.num_blocks, kv_cache_dtype=str(llm.kv.dtype).replace("torch.", ""),
                  engine_init_s=init_s, engine=dataclasses.asdict(ecfg),
                  bench=dataclasses.asdict(cfg), peer_note=peer_note, cases=[])
    for case in make_cases(cfg.small, cfg.cases):
        llm.capture_graphs()  # after a wake() the graphs are gone: capture outside the timing
        llm.stats.reset()
        _sync(device)
        v0 = triton_compiles()
        t0 = time.perf_counter()
        outs = llm.generate(case.prompts, case.params)
        _sync(device)
        dt = time.perf_counter() - t0
        compiles = new_compiles(v0, triton_compiles())  # Triton compiles the timing paid for
        n_out = sum(len(o.output_token_ids) for o in outs)
        expect = sum(p.max_tokens * p.n for p in case.params)
        bound = n_out / (bound_bytes(case, weight_bytes, kv_per_token, state_step, experts) / bw)
        own = n_out / (bound_bytes(case, weight_bytes, kv_own, state_step, experts) / bw)
        row = dict(case=case.name, sequences=len(outs), prompt_tokens=sum(len(p) * q.n for p, q in
                   zip(case.prompts, case.params)), output_tokens=n_out, complete=n_out == expect,
                   engine_s=dt, engine_tok_s=n_out / dt, bound_tok_s=bound, pct_bound=100 * n_out / dt / bound,
                   pct_own_bound=100 * n_out / dt / own,
                   stats=dataclasses.asdict(llm.stats), triton_compiles_in_timed_run=compiles)
        if case.name == "nanovllm" and not cfg.small:
            # the same case again: separates first-use costs (Triton compiles of new kernel
            # specializations) from the steady state; the protocol's number is the first run
            llm.stats.reset()
            _sync(device)
            t1 = time.perf_counter()
            llm.generate(case.prompts, case.params)
            _sync(device)
            row["engine_tok_s_second_run"] = n_out / (time.perf_counter() - t1)
            row["stats_second_run"] = dataclasses.asdict(llm.stats)
        log.info("bench %s engine: %.1f s, stats %s%s", case.name, dt, row["stats"],
                 f", second run {row['engine_tok_s_second_run']:.0f} tok/s" if "engine_tok_s_second_run" in row
                 else "")
        if case.name == "grpo":
            g = case.params[0].n
            P = len(case.prompts[0])
            once = len(case.prompts) * (P + (g - 1) * (P % ecfg.block_size))
            row["prefill_once_expected"] = once
            row["prefill_once"] = llm.stats.prompt_tokens_computed == once
        if cfg.peer and not peer_note:
            llm.sleep()
            if hf is None:
                hf, rel = _hf_model(model)
                result["peer_logits_rel_err"] = rel
                _peer_generate(hf, Case("warm", case.prompts[:1], [SamplingParams(max_tokens=4)]), 1, 1, 0)
            tok, pdt = _peer_generate(hf, case, cfg.peer_batch, cfg.peer_max_seqs, 0)
            row.update(peer_tok_s=tok / pdt, peer_s=pdt, peer_seqs=min(len(case.prompts), cfg.peer_max_seqs or 10**9),
                       x_peer=(n_out / dt) / (tok / pdt))
            llm.wake()
        result["cases"].append(row)
        log.info("bench %s: %.0f tok/s engine, %.0f%% of bound%s", case.name, row["engine_tok_s"], row["pct_bound"],
                 f", {row['x_peer']:.1f}x peer" if "x_peer" in row else "")
    return result


def table(result: dict) -> str:
    lines = ["| case | seqs | output tokens | engine tok/s | bound tok/s | % of bound | peer tok/s | x peer | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        st = r["stats"]
        notes = f"{st['steps']} steps ({st['graph_steps']} graph, {st['look_ahead_steps']} look-ahead, " \
                f"{st.get('shared_prefix_steps', 0)} shared-prefix), " \
                f"{st['preemptions']} preemptions, Triton compiles in the timed run: " \
                f"{sum(r['triton_compiles_in_timed_run'].values())}"
        if r.get("pct_own_bound", r["pct_bound"]) != r["pct_bound"]:
            notes += f"; fp8 KV: {r['pct_own_bound']:.0f}% of the 1-byte-KV bound"
        if "engine_tok_s_second_run" in r:
            notes += f"; same case again: {r['engine_tok_s_second_run']:,.0f} tok/s"
        if r["case"] == "grpo":
            notes += (f"; prompt tokens computed {st['prompt_tokens_computed']:,} (once per group: "
                      f"{r['prefill_once_expected']:,}), cached {st['prompt_tokens_cached']:,}")
        peer = (f"{r['peer_tok_s']:,.0f}", f"{r['x_peer']:.1f}") if "peer_tok_s" in r else ("n/a", "n/a")
        lines.append(f"| {r['case']} | {r['sequences']} | {r['output_tokens']:,} | {r['engine_tok_s']:,.0f} | "
                     f"{r['bound_tok_s']:,.0f} | {r['pct_bound']:.0f}% | {peer[0]} | {peer[1]} | {notes} |")
    return "\n".join(lines)
