"""Coming from TRL: the same recipe gives TRL's loss and gradients (issue 25).

Both libraries train one tiny Qwen3 (fp32, CPU, random weights saved as an HF folder)
on one fixed batch: 2 prompts x 4 completions whose token ids are fixed (some end in
EOS, some are cut at max_completion_length) and whose rewards are fixed. Generation is
the only part replaced: TRL gets the completions through its `rollout_func` hook, rlfuse
through a sampler that returns them; everything after that is each library's own code
path (TRL: `GRPOTrainer.train()`; rlfuse: `GRPOStep.step`): advantages, truncation
masks, old and reference log-probs, micro-batching, the loss and its backward, AdamW.

Each case runs two optimizer steps on the same batch (TRL `num_iterations=2`, rlfuse
`grpo.mu=2`): the first is on-policy (ratio 1), the second off-policy (the old
log-probs are the batch's, the weights have moved by one AdamW step at lr 2e-2, so
ratios leave the clip range). Before each step the gradients of every parameter and
the loss are compared; the clip fractions are checked to be nonzero where a case is
about clipping. Tolerance: fp32 rounding of two different forward implementations
(rlfuse's model vs transformers' Qwen3, ~1e-7 relative on log-probs).

Requires the optional test dependency `trl` (`pip install -e .[trl]`; part of `dev`).
Run: PYTHONPATH=$PWD python -m pytest -q tests/test_trl_parity.py
"""

from __future__ import annotations

import json
import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="the TRL parity test needs the optional dependency trl (pip install -e .[trl])")

import transformers  # noqa: E402
from tiny_hf import hf_config, randomize_  # noqa: E402
from train_setup import one_thread  # noqa: E402

from rlfuse.data import PromptStream, build_preference_pairs, build_prompts  # noqa: E402
from rlfuse.engine.config import logprob_temperature  # noqa: E402
from rlfuse.kernels.loss.logprob import token_logprobs  # noqa: E402
from rlfuse.model import Packed  # noqa: E402
from rlfuse.rollout.sampler import Sample  # noqa: E402
from rlfuse.run.build import char_tokenizer  # noqa: E402
from rlfuse.run.config import load_config  # noqa: E402
from rlfuse.run.optim import MasterAdamW  # noqa: E402
from rlfuse.train.dpo import DPOStep as RlfuseDPO  # noqa: E402
from rlfuse.train.grpo import GRPOStep as RlfuseGRPO  # noqa: E402
from rlfuse.train.session import open_session  # noqa: E402

ALPHABET = "0123456789+=abcdefgh "
PAD, EOS = 0, 1  # char_tokenizer's ids
PROMPTS = ["3+4=", "12+5="]
G = 4
MAX_LEN = 5
# completion token ids per prompt (char ids >= 3); a list ending in EOS terminated, one of
# MAX_LEN tokens without EOS was cut (truncated); rewards by completion, all distinct
COMPLETIONS = [[[10, EOS], [9, 12, 4, 5, 6], [10, 3, EOS], [14, 15, 16, 17, 18]],
               [[4, 10, EOS], [4, 10, 3, 3, EOS], [20, 19, 18, 17, 16], [EOS]]]
REWARDS = [[1.0, 0.0, 0.5, 0.25], [0.0, 1.0, 0.2, 0.7]]
_REWARD_OF = {tuple(c): r for cs, rs in zip(COMPLETIONS, REWARDS) for c, r in zip(cs, rs)}
# AdamW's first step is lr * g / (|g| + eps): with the usual eps 1e-8 every entry moves by
# ~lr whatever its size, so an entry near 0 whose sign rounding decides moves by +-lr in one
# library and the other; eps 1 makes the step linear in g (lr g), so step 2 compares
# gradients at weights that agree to rounding. lr 1 then moves the policy enough that
# ratios leave the clip range on both sides (clip fractions ~0.3-0.9 in step 2).
LR, ADAM_EPS = 1.0, 1.0


def fixed_reward(prompts, completions, completion_ids, **_):
    """The batch's fixed rewards, looked up by completion ids (TRL's reward signature)."""
    return [_REWARD_OF[tuple(ids)] for ids in completion_ids]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():  # ~10x faster for these tiny models on a shared 2-core machine
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Qwen3 in an HF folder with a character tokenizer."""
    path = tmp_path_factory.mktemp("tiny_qwen3")
    tok = char_tokenizer(ALPHABET)
    tok.save(path)
    cfg = hf_config("qwen3", vocab_size=tok.vocab_size, bos_token_id=None, eos_token_id=EOS, pad_token_id=PAD)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize_(hf, seed=3).save_pretrained(path)
    (path / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


# ---------------------------------------------------------------------- rlfuse's side
class FixedSampler:
    """The rlfuse `Sampler` interface over the fixed completions: their log-probs are the
    model's own at sampling time (the engine's rollout log-probs)."""

    def __init__(self, model, by_prompt: dict[tuple, list[list[int]]]):
        self.model, self.by_prompt = model, by_prompt

    @torch.no_grad()
    def generate(self, prompt_ids, *, n, temperature, top_p, top_k, max_tokens, seed):
        out = []
        for i, p in enumerate(prompt_ids):
            for c in self.by_prompt[tuple(p)][:n]:
                ids = torch.tensor(p + c)
                h = self.model(ids, torch.arange(len(ids)), Packed.from_lengths([len(ids)], ids.device))
                lp = token_logprobs(h[len(p) - 1:-1], self.model.lm_head_weight, torch.tensor(c),
                                    logprob_temperature(temperature))
                out.append(Sample(i, list(c), lp.float(), c[-1] != EOS, ""))
        return out

    def sleep(self):
        pass

    def wake(self):
        pass


class RecordingAdamW(MasterAdamW):
    """MasterAdamW that records every parameter's gradient (by name) before each step."""

    def __init__(self, model, **kw):
        super().__init__(model.parameters(), **kw)
        self.named = list(model.named_parameters())
        self.grads_at_step: list[dict] = []

    def step(self, lr=None):
        self.grads_at_step.append({n: p.grad.detach().clone() for n, p in self.named if p.grad is not None})
        super().step(lr)


def record_losses(tr):
    """Record the loss and statistics of each of the trainer's `accumulate_gradients` calls
    (the update calls it through the instance, so the wrapper sees every one)."""
    inner = tr.update.accumulate_gradients
    tr.losses, tr.stats = [], []

    def accumulate_gradients(*a, **k):
        sums, n = inner(*a, **k)
        tr.losses.append(sums["loss"].detach().clone())
        tr.stats.append({key: float(v) for key, v in sums.items()})
        return sums, n
    tr.update.accumulate_gradients = accumulate_gradients
    return tr


def run_rlfuse(folder, tmp_path, grpo: dict):
    cfg = load_config({
        "model": {"path": str(folder), "dtype": "float32", "device": "cpu", "kernel_backend": "torch"},
        "data": {"train": str(folder / "train.jsonl"), "shuffle": False, "max_prompt_len": 16},
        "rewards": [{"name": f"{os.path.abspath(__file__)}:fixed_reward"}],
        # in this process: a worker would import this file (torch, transformers, trl: ~6 s a
        # case); the worker's own contract is tested in test_bad_inputs.py ("hung or worker")
        "reward_timeout_s": 0,
        "optim": {"lr": LR, "eps": ADAM_EPS, "schedule": "constant", "max_grad_norm": 0.0},
        "grpo": {"steps": 1, "prompts_per_step": len(PROMPTS), "group_size": G, "max_new_tokens": MAX_LEN,
                 "adv_eps": 1e-4, "mu": 2, "sample_every": 0, "log_entropy": False, **grpo},
        "logging": {"run_dir": str(tmp_path / "rlfuse"), "tensorboard": False, "progress": False},
        "checkpoint": {"save_final": False},
    })
    ses = open_session(cfg)
    prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data)
    ses._sampler = FixedSampler(ses.model, {tuple(p.ids): c for p, c in zip(prompts, COMPLETIONS)})
    o = cfg.optim
    opt = RecordingAdamW(ses.model, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    tr = record_losses(RlfuseGRPO(cfg, ses.model, ses.sampler, ses.rewards(), PromptStream(prompts, shuffle=False), opt))
    tr.step(0)
    return tr.losses, opt.grads_at_step, tr.stats, {p.text: p.ids for p in prompts}


# ---------------------------------------------------------------------- TRL's side
class _GradRecorder(transformers.TrainerCallback):
    def __init__(self):
        self.grads: list[dict] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


class _LossRecordingTRL(trl.GRPOTrainer):
    """TRL's trainer, recording the loss of each micro-batch (already scaled for
    gradient accumulation, so one optimizer step's losses sum to its full loss)."""

    def compute_loss(self, model, inputs, *a, **k):
        loss = super().compute_loss(model, inputs, *a, **k)
        self.micro_losses = getattr(self, "micro_losses", []) + [loss.detach().clone()]
        return loss


def run_trl(folder, tmp_path, prompt_ids: dict, args: dict, grad_accum: int = 1):
    import datasets

    def rollout(prompts, trainer):
        seen: dict[str, int] = {}
        p_ids, c_ids = [], []
        for p in prompts:
            k = seen[p] = seen.get(p, -1) + 1
            p_ids.append(prompt_ids[p])
            c_ids.append(COMPLETIONS[PROMPTS.index(p)][k])
        return {"prompt_ids": p_ids, "completion_ids": c_ids, "logprobs": [[0.0] * len(c) for c in c_ids]}

    torch.manual_seed(0)
    batch = len(PROMPTS) * G
    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=batch // grad_accum, gradient_accumulation_steps=grad_accum,
        num_generations=G, max_completion_length=MAX_LEN, num_iterations=2, max_steps=2,
        learning_rate=LR, adam_epsilon=ADAM_EPS, lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=0.0,
        shuffle_dataset=False, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, **args)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    rec = _GradRecorder()
    trainer = _LossRecordingTRL(model=str(folder), reward_funcs=[fixed_reward], args=config,
                                train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                                processing_class=tok, rollout_func=rollout, callbacks=[rec])
    trainer.train()
    losses = [torch.stack(trainer.micro_losses[i * grad_accum:(i + 1) * grad_accum]).sum() for i in range(2)]
    return losses, rec.grads, trainer


def _worst(a: dict, b: dict) -> float:
    """Largest |a - b| of any parameter's gradient, relative to that gradient's largest entry."""
    return max((float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12)), n) for n in b)


# (TRL GRPOConfig arguments, rlfuse grpo keys, TRL gradient accumulation steps); rlfuse
# micro-batches by tokens (micro_batch_tokens 24: 3-4 micro-batches of the 8 sequences)
CASES = {
    "grpo": ({"loss_type": "grpo"}, {"loss_type": "grpo"}, 1),
    "grpo-accum": ({"loss_type": "grpo"}, {"loss_type": "grpo", "micro_batch_tokens": 24}, 2),
    "dapo-accum": ({"loss_type": "dapo"}, {"loss_type": "dapo", "micro_batch_tokens": 24}, 2),
    "dr_grpo-unscaled": ({"loss_type": "dr_grpo", "scale_rewards": "none"},
                         {"loss_type": "dr_grpo", "adv_scale": "none"}, 2),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.1, "epsilon_high": 0.15},
             {"loss_type": "gspo", "clip_low": 0.1, "clip_high": 0.15}, 1),
    "clip_higher-batch_std": ({"loss_type": "dapo", "epsilon_high": 0.28, "scale_rewards": "batch"},
                              {"loss_type": "dapo", "clip_high": 0.28, "adv_scale": "batch"}, 1),
    "dual_clip": ({"loss_type": "grpo", "delta": 1.25}, {"loss_type": "grpo", "dual_clip": 1.25}, 1),
    "mask_truncated": ({"loss_type": "dapo", "mask_truncated_completions": True},
                       {"loss_type": "dapo", "mask_truncated": True}, 2),
    "kl": ({"loss_type": "dapo", "beta": 0.5, "use_bias_correction_kl": False},
           {"loss_type": "dapo", "kl_coef": 0.5, "kl_type": "k3"}, 1),
    # TRL's default: the KL term weighted by the ratio (use_bias_correction_kl)
    "kl_ratio": ({"loss_type": "dapo", "beta": 0.2}, {"loss_type": "dapo", "kl_coef": 0.2, "kl_ratio": True}, 2),
    "temperature": ({"loss_type": "grpo", "temperature": 0.7}, {"loss_type": "grpo", "temperature": 0.7}, 1),
    # TRL's cispo caps the weight at epsilon_high itself (not 1 + epsilon_high)
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.28}, {"loss_type": "cispo", "clip_high": 0.28}, 2),
    # bnpo normalizes by each micro-batch's tokens: with one micro-batch per step it is dapo
    "bnpo-one-micro-batch": ({"loss_type": "bnpo"}, {"loss_type": "dapo"}, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_loss_and_gradients_as_trl(folder, tmp_path, case):
    trl_args, grpo, accum = CASES[case]
    rl_losses, rl_grads, stats, prompt_ids = run_rlfuse(folder, tmp_path, grpo)
    trl_losses, trl_grads, _ = run_trl(folder, tmp_path, prompt_ids, trl_args, grad_accum=accum)
    assert len(rl_grads) == len(trl_grads) == 2
    for step in range(2):
        what = f"{case}, optimizer step {step + 1} ({'on' if step == 0 else 'off'}-policy)"
        torch.testing.assert_close(rl_losses[step].float(), trl_losses[step].float(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, what=what: f"{what}: loss differs\n{m}")
        assert set(rl_grads[step]) == set(trl_grads[step]), f"{what}: parameter names differ"
        worst, wname = _worst(rl_grads[step], trl_grads[step])
        print(f"{what}: loss {float(rl_losses[step]):.6g} vs {float(trl_losses[step]):.6g}, "
              f"worst relative gradient difference {worst:.2g} ({wname}), stats {stats[step]}")
        assert worst < 2e-5, f"{what}: gradients differ (worst {worst:.3g} of the largest entry)"
    # the second step is off-policy, and the case's feature acts on it
    off = stats[1]
    assert off["ratio_mean"] != 1.0 and off["clip_frac"] > 0, off
    if "dual_clip" in grpo:
        assert off["clip_frac"] > off["clip_frac_low"] + off["clip_frac_high"], off  # the cap binds
    if "kl_coef" in grpo:
        assert off["kl"] > 0, off


# ---------------------------------------------------------------------- DPO
PAIRS = [("3+4=", "7", "8"), ("12+5=", "17", "71"), ("9+9=", "18", "19"), ("20+1=", "21", "2")]


@pytest.mark.parametrize("reference", ["precompute", "live"])
def test_dpo_sigmoid_same_loss_and_gradients_as_trl(folder, tmp_path, reference):
    """DPO with the sigmoid loss on 4 fixed (prompt, chosen, rejected) text pairs, two AdamW
    steps (the first at the reference, h = 0; the second with h != 0): rlfuse's
    `DPOStep.step` against `trl.DPOTrainer.train()`; TRL accumulates 2 micro-batches of 2
    pairs, rlfuse packs by tokens. `reference` pairs rlfuse's dpo.reference with TRL's
    precompute_ref_log_probs."""
    import datasets

    data = folder / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in PAIRS))
    beta = 0.5
    cfg = load_config({
        "model": {"path": str(folder), "dtype": "float32", "device": "cpu", "kernel_backend": "torch"},
        "data": {"train": str(data), "shuffle": False, "max_prompt_len": 16},
        "optim": {"lr": LR, "eps": ADAM_EPS, "schedule": "constant", "max_grad_norm": 0.0},
        "dpo": {"steps": 2, "batch_size": len(PAIRS), "micro_batch_tokens": 24, "beta": beta, "loss": "sigmoid",
                "reference": reference},
        "logging": {"run_dir": str(tmp_path / "rlfuse"), "tensorboard": False, "progress": False},
        "checkpoint": {"save_final": False},
    })
    ses = open_session(cfg)
    o = cfg.optim
    opt = RecordingAdamW(ses.model, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    tr = RlfuseDPO(cfg, ses.model, opt, build_preference_pairs(ses.train_rows, ses.tokenizer, cfg.data, cfg.dpo))
    rl_metrics = [tr.step(0), tr.step(1)]

    class LossRecordingDPO(trl.DPOTrainer):
        def compute_loss(self, model, inputs, *a, **k):
            loss = super().compute_loss(model, inputs, *a, **k)
            self.micro_losses = getattr(self, "micro_losses", []) + [loss.detach().clone()]
            return loss

    torch.manual_seed(0)
    rec = _GradRecorder()
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, beta=beta,
                         loss_type=["sigmoid"], precompute_ref_log_probs=reference == "precompute",
                         per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                         learning_rate=LR, adam_epsilon=ADAM_EPS, lr_scheduler_type="constant", optim="adamw_torch",
                         max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    trainer = LossRecordingDPO(model=str(folder), args=args, processing_class=tok,
                               train_dataset=datasets.Dataset.from_list(
                                   [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]),
                               callbacks=[rec])
    trainer.train()
    # HF's Trainer divides each micro-batch loss by the accumulation steps after compute_loss
    trl_losses = [sum(trainer.micro_losses[2 * i:2 * i + 2]) / 2 for i in range(2)]
    assert len(opt.grads_at_step) == len(rec.grads) == 2
    for step in range(2):
        what = f"dpo ({reference} reference), optimizer step {step + 1}"
        torch.testing.assert_close(torch.as_tensor(rl_metrics[step]["loss"]).float(), trl_losses[step].float(),
                                   rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: loss differs\n{m}")
        worst, wname = _worst(opt.grads_at_step[step], rec.grads[step])
        print(f"{what}: loss {float(rl_metrics[step]['loss']):.6g} vs {float(trl_losses[step]):.6g}, "
              f"margin {float(rl_metrics[step]['rewards/margin']):.4g}, worst relative gradient difference "
              f"{worst:.2g} ({wname})")
        assert worst < 2e-5, f"{what}: gradients differ (worst {worst:.3g} of the largest entry, {wname})"
    assert float(rl_metrics[1]["rewards/margin"]) != 0.0  # the second step is away from the reference
