"""Generation throughput: the engine vs transformers `generate` vs the bandwidth bound.

Model: Qwen3-0.6B-shaped, random weights (hidden 1024, 28 layers, 16 q / 8 kv heads of
128, vocab 151936, tied), bf16; `shape` picks another shape (`SHAPES`: Qwen3 0.6b..8b,
Qwen3.5 3.5-0.8b / 3.5-2b hybrids, the MoE 30b-a3b / 35b-a3b and the unpublished moe-3b).
Cases (all temperature-sampled, ignore_eos):
  nanovllm  the protocol nano-vllm and RL.cu publish: Python random.seed(0); 256 prompts
            of U[100, 1024] ids ~ U[0, 10000], then per sequence max_tokens ~ U[100, 1024]
            (drawn in that order), temperature 0.6; one-sequence warm-up first;
  fixed     256 prompts of 128 ids, 512 new tokens each, temperature 0.6;
  grpo      32 prompts of 250 ids x n = 8 completions of 512 tokens, temperature 1.0;
            counts prompt tokens computed vs taken from the prefix cache (each prompt
            once + 7 x (250 mod 16) tail tokens: 32 * 250 + 32 * 7 * 10 = 10,240);
  decode    256 prompts of 512 ids, 256 new tokens each, temperature 0.6 (issue 34's decode
            target: B = 256 with 512-token prompts).
Throughput = output tokens / wall time of the whole `generate` (prefill included).
With `kv_cache_dtype: fp8_e4m3` (`--kv-cache-dtype`), % of bound is still against the bound
of a cache in the model's dtype (K/V at 2 bytes): what fp8 buys shows as a % above that
bound's share; `pct_own_bound` is against the 1-byte bound.

Bandwidth bound (an upper limit no schedule can beat): every decode step reads all
weights once (`W` bytes: every parameter, the tied LM head once) and, for each sequence,
the K/V of its context (`kv` bytes/token = 2 * L * Hkv * Dh * 2, L = the layers keeping
K/V: every layer of a dense model, the full-attention ones of a hybrid), and on a hybrid
reads and writes each linear-attention layer's recurrent state once (`st` bytes a sequence
and step = 2 * sum over those layers of (Hv Dk Dv * 4 + conv channels (W-1) * 2): the
state a one-token recurrence must move; the engine's exact-contract step also reads the
tail of < 64 buffered tokens, not counted). With all sequences in one batch, sequence i
(prompt P_i, O_i outputs, the first from prefill) costs decode steps j = 1 .. O_i - 1
reading P_i + j tokens; the batch takes max_i O_i - 1 steps:
    bytes = (max_i O_i - 1) * W + kv * sum_i [(O_i - 1) P_i + O_i (O_i - 1) / 2]
            + st * sum_i (O_i - 1)
    bound = sum_i O_i / (bytes / BW),  BW = device-to-device copy (read + write bytes / s)
measured in the same run. Prefill time is not in the bound, so % of bound is conservative.
On an MoE shape `W` counts the routed experts a step touches, not all of them (`bound_bytes`:
uniform routing, b running sequences touch 1 - (1 - k/E)^b of a layer's E experts; at
30B-A3B's E = 128, k = 8 that is 98% at b = 64: the bound matters at small batches).

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
import random
import time

import torch

from rlfuse.engine.cache import kv_layers, linear_layers
from rlfuse.engine.config import EngineConfig, SamplingParams
from rlfuse.engine.llm import LLM
from rlfuse.kernels.backend import new_compiles, triton_compiles
from rlfuse.model import CausalLM
from rlfuse.model.arch.qwen3_5 import tiny_hybrid_fields
from rlfuse.model.config import ModelConfig

log = logging.getLogger(__name__)


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tied: bool) -> dict:
    return dict(model_type="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, head_dim=128,
                qk_norm=True, tie_word_embeddings=tied, rope_theta=1e6, max_position_embeddings=40960)


# the published config.json of Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B}: the shapes every benchmark
# uses (with random weights); one definition, benchmarks override max_position_embeddings if needed.
# 14B and 32B: issue 39's largest shapes (14B full fine-tune on 4 GPUs, 32B LoRA on one H200)
QWEN3_SHAPES = {
    "0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "14b": _qwen3(5120, 17408, 40, 40, tied=False),
    "32b": _qwen3(5120, 25600, 64, 64, tied=False),
}
QWEN3_06B = QWEN3_SHAPES["0.6b"]
# MoE shapes of issue 36's targets (random weights): Qwen/Qwen3-30B-A3B's published config,
# Qwen3.5-35B-A3B's text model as transformers' Qwen3_5MoeTextConfig defaults describe it
# (rope theta and the like do not change a step's time and are left at our defaults), and
# "moe-3b", no published model: Qwen3-30B-A3B's layer scaled down (hidden 1024, 24 layers, 64
# experts of width 512, top-8) to 2.9 B parameters (0.74 B active), small enough for full
# fine-tuning on one GPU, the 1-GPU reference of the FSDP2 runs (bench_multi_gpu.py moe)
MOE_SHAPES = {
    "moe-3b": dict(_qwen3(1024, 3072, 24, 16, tied=False), model_type="qwen3_moe", num_key_value_heads=4,
                   moe=dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, norm_topk_prob=True)),
    "30b-a3b": dict(_qwen3(2048, 6144, 48, 32, tied=False), model_type="qwen3_moe", num_key_value_heads=4,
                    moe=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                             norm_topk_prob=True)),
    "35b-a3b": dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                    num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
                    tie_word_embeddings=False, max_position_embeddings=40960,
                    layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                      for i in range(40)),
                    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_num_key_heads=16, linear_num_value_heads=32,
                    moe=dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, norm_topk_prob=True,
                             shared_expert_intermediate_size=512)),
}


def _qwen3_5(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, lin_k: int, lin_v: int) -> dict:
    return dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256,
                partial_rotary_factor=0.25, rope_theta=1e7, tie_word_embeddings=True, max_position_embeddings=262144,
                layer_types=(("linear_attention",) * 3 + ("full_attention",)) * (layers // 4),
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=lin_k, linear_num_value_heads=lin_v)


# the text towers of the published Qwen/Qwen3.5-{0.8B,2B} config.json (three Gated DeltaNet
# layers then one gated full-attention layer, repeated), with random weights; ~0.75 B and
# ~1.9 B parameters here (no vision tower, no MTP head). The dense shape of about the same
# size as 3.5-2b is Qwen3-1.7B (1.7 B).
QWEN3_5_SHAPES = {
    "3.5-0.8b": _qwen3_5(1024, 3584, 24, 8, 2, 16, 16),
    "3.5-2b": _qwen3_5(2048, 6144, 24, 8, 2, 16, 16),
}
SHAPES = {**QWEN3_SHAPES, **QWEN3_5_SHAPES, **MOE_SHAPES}
TINY = dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, qk_norm=True,
            tie_word_embeddings=True, max_position_embeddings=512)


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


@dataclasses.dataclass(slots=True)
class Case:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def n(self) -> list[int]:
        return [p.n for p in self.params]


def make_cases(small: bool, names) -> list[Case]:
    """The three cases; `small` divides lengths and counts (ids < 150 for the tiny vocab)."""
    d, id_hi = (32, 150) if small else (1, 10000)
    out = []
    for name in names:
        if name == "nanovllm":  # draws in nano-vllm's order: prompt lengths and ids, then max_tokens
            rng = random.Random(0)
            n, lo, hi = 256 // d, 100 // d, 1024 // d
            prompts = [[rng.randint(0, id_hi) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(lo, hi))
                      for _ in range(n)]
        elif name == "fixed":
            rng = random.Random(1)
            n, P, O = (8, 16, 16) if small else (256, 128, 512)
            prompts = [[rng.randint(0, id_hi) for _ in range(P)] for _ in range(n)]
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=O)] * n
        elif name == "decode":
            rng = random.Random(3)
            n, P, O = (8, 16, 16) if small else (256, 512, 256)
            prompts = [[rng.randint(0, id_hi) for _ in range(P)] for _ in range(n)]
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=O)] * n
        elif name == "grpo":
            rng = random.Random(2)
            n, g, P, O = (4, 4, 25, 16) if small else (32, 8, 250, 512)
            prompts = [[rng.randint(0, id_hi) for _ in range(P)] for _ in range(n)]
            params = [SamplingParams(n=g, temperature=1.0, ignore_eos=True, max_tokens=O, seed=i) for i in range(n)]
        else:
            raise ValueError(f"bench case {name!r}: expected one of nanovllm, fixed, grpo, decode")
        out.append(Case(name, prompts, params))
    return out


def bound_bytes(case: Case, weight_bytes: int, kv_per_token: int, state_per_step: int = 0,
                experts: tuple[int, int, int] | None = None) -> int:
    """experts: (bytes of the routed experts' weights, E, top-k) of an MoE model. A step then
    reads the dense weights and the experts its running sequences touch; under uniform
    routing a layer's expert is touched by one of b tokens with probability 1 - (1 - k/E)^b
    (an estimate: trained routers are skewed, which touches fewer)."""
    steps, kv, seq_steps, ends = 0, 0, 0, []
    for prompt, p in zip(case.prompts, case.params):
        P, O = len(prompt), p.max_tokens
        steps = max(steps, O - 1)
        kv += p.n * ((O - 1) * P + O * (O - 1) // 2)
        seq_steps += p.n * (O - 1)
        ends += [O - 1] * p.n
    if experts is None:
        return steps * weight_bytes + kv * kv_per_token + seq_steps * state_per_step
    eb, E, k = experts
    ends.sort()
    w, i = 0.0, 0
    for step in range(steps):  # a sequence with O - 1 decode steps runs in steps 0 .. O - 2
        while i < len(ends) and ends[i] <= step:
            i += 1
        w += weight_bytes - eb + eb * (1 - (1 - k / E) ** (len(ends) - i))
    return round(w) + kv * kv_per_token + seq_steps * state_per_step


def routed_expert_bytes(model: CausalLM) -> tuple[int, int, int] | None:
    """(bytes of every MoE layer's routed experts, E, top-k), or None for a dense model. The
    shared experts and routers are dense: read every step."""
    moe = getattr(model.config, "moe", None)
    if moe is None:
        return None
    eb = sum(t.numel() * t.element_size() for n, t in model.named_parameters()
             if ".experts." in f".{n}." and "shared_expert" not in n)
    return (eb, moe.num_experts, moe.num_experts_per_tok) if eb else None


def state_bytes_per_step(model: CausalLM) -> int:
    """Bytes of linear-attention state one sequence's decode step must read and write (the
    module docstring's `st`; 0 for a dense model)."""
    itemsize = model.lm_head_weight.element_size()
    one = sum(m.n_v * m.dk * m.dv * 4 + m.conv_dim * (m.width - 1) * itemsize for _, m in linear_layers(model))
    return 2 * one


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting read + write."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    reps = 20
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    _sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A CausalLM of `shape` (ModelConfig fields) with random weights made directly on
    `device` in `dtype` (built on the meta device, then allocated): an 8B model never
    passes through fp32 on the CPU."""
    with torch.device("meta"):
        model = CausalLM(ModelConfig(**shape))
    model = model.to(dtype).to_empty(device=device)
    model.init_weights(std=0.02, generator=torch.Generator(device).manual_seed(seed))
    return model.eval()


def build_model(small: bool, device: torch.device, seed: int, shape: str = "0.6b") -> CausalLM:
    """The benchmark's model; `small`: a tiny fp32 one of the same kind (hybrid or dense)."""
    if shape not in SHAPES:
        raise ValueError(f"bench shape {shape!r}: expected one of {sorted(SHAPES)}")
    hybrid, moe = "layer_types" in SHAPES[shape], "moe" in SHAPES[shape]
    if small:  # an MoE shape: the tiny dense model with 4 routed experts (top-2), so the MoE bound runs
        tiny = tiny_hybrid_fields() if hybrid else TINY
        if moe and not hybrid:
            tiny = dict(TINY, model_type="qwen3_moe", moe=dict(num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=32, norm_topk_prob=True))
        return random_model(tiny, device, torch.float32, seed)
    return random_model(SHAPES[shape], device, torch.bfloat16, seed)


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
