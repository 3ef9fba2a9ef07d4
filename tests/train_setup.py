"""Tiny runs for the trainer tests: a 1-layer Qwen3-style model, a character tokenizer,
built-in arithmetic and the TinySampler (no engine), fp32 on CPU."""

from __future__ import annotations

import yaml
from tiny_sampler import TinySampler

from rlfuse.run.config.run_config import load_config
from rlfuse.train.session import open_session

TINY_MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64)


def tiny_cfg(run_dir, *overrides: str, **sections):
    base = {
        "seed": 0,
        "model": {"random_init": TINY_MODEL, "tokenizer": "char", "dtype": "float32", "device": "cpu",
                  "kernel_backend": "torch"},
        "data": {"train": "builtin:arithmetic", "task": {"digits": 1, "ops": "+-"}, "train_size": 150,
                 "eval_size": 20, "max_prompt_len": 16},
        # a random model never solves a problem; the length term gives every group reward variance
        "rewards": [{"name": "arithmetic"}, {"name": "length_penalty", "kwargs": {"max_len": 3}}],
        "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
        "sft": {"steps": 4, "batch_size": 8, "micro_batch_tokens": 40},
        "grpo": {"steps": 4, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 3, "sample_every": 2},
        "logging": {"run_dir": str(run_dir), "tensorboard": False, "progress": False},
        "checkpoint": {"every": 0, "save_final": False},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return load_config(base, list(overrides))


def tiny_recipe(path, **sections):
    """A recipe file for the CLI tests (the engine generates, so kernel_backend stays auto):
    the tiny model on 1-digit addition, a few SFT and GRPO steps; `sections` update it."""
    cfg = {
        "model": {"random_init": TINY_MODEL, "tokenizer": "char", "dtype": "float32", "device": "cpu"},
        "data": {"train": "builtin:arithmetic", "task": {"digits": 1, "ops": "+"}, "train_size": 60,
                 "eval_size": 10, "max_prompt_len": 8},
        "rewards": [{"name": "arithmetic"}, {"name": "length_penalty", "kwargs": {"max_len": 3}}],
        "optim": {"lr": 1e-2, "schedule": "constant"},
        "sft": {"steps": 3, "batch_size": 8},
        "grpo": {"steps": 2, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 3},
        "engine": {"max_num_seqs": 16},
        "logging": {"tensorboard": True, "progress": False},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    path.write_text(yaml.safe_dump(cfg))
    return path


def tiny_session(cfg, need_target=False):
    ses = open_session(cfg, need_target=need_target)
    ses._sampler = TinySampler(ses.model, ses.tokenizer)
    return ses


class one_thread:
    """torch on one CPU thread inside the block (restored after): the tiny and 135M models
    here run 2-4x faster single-threaded on the shared 2-core CI machine."""

    def __enter__(self):
        import torch

        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.n)
