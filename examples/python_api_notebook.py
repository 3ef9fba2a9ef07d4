# %% [markdown]
# # rlfuse from a notebook
# Cells for Jupyter / VS Code (`# %%`), or run it as a script. A tiny random model on the
# "reverse a word" data shipped in examples/data: SFT, then GRPO with a reward defined in a
# cell, then generation and export, all in one process on one copy of the weights.
# Run from the repository root; a few minutes on a CPU.

# %%
import json
from pathlib import Path

from rlfuse import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer, load_model

ROOT = Path("runs/notebook")
rows = [json.loads(x) for x in Path("examples/data/reverse_train.jsonl").read_text().splitlines()]
held_out = [json.loads(x) for x in Path("examples/data/reverse_eval.jsonl").read_text().splitlines()]
rows[0]

# %% [markdown]
# A model folder: any HF folder (Llama, Qwen2, Qwen3). Here a tiny random one with a
# character tokenizer, written by the example script.

# %%
import subprocess
import sys

subprocess.run([sys.executable, "examples/make_tiny_model.py", str(ROOT / "tiny-model"), "--data",
                "examples/data/reverse_train.jsonl", "examples/data/reverse_eval.jsonl"], check=True)

# %% [markdown]
# ## SFT on a list of dicts
# Rows are `{"prompt", "completion"}` (or chat `messages`); a `datasets.Dataset` works too.
# `config` takes any recipe key (docs/configuration.md); `args` is the algorithm's section.

# %%
common = {"model": {"dtype": "float32"}, "data": {"max_prompt_len": 32}, "logging": {"progress": False}}
sft = SFTTrainer(str(ROOT / "tiny-model"), train_dataset=rows,
                 args=SFTConfig(steps=80, batch_size=32, max_seq_len=32),
                 config={**common, "optim": {"lr": 2e-3, "warmup_steps": 10}}, run_dir=ROOT / "sft", overwrite=True)
sft.generate(["reverse abc:"], max_tokens=8)  # before training: noise

# %%
summary = sft.train()
[round(r["loss"], 3) for r in summary["history"][::10]]

# %% [markdown]
# ## GRPO with a reward written here
# TRL's signature: prompts, completions, then the dataset's other columns by name.

# %%
def reverse_reward(prompts, completions, answer, **columns):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def shorter(prompts, completions, **kw):
    return [-0.01 * len(c) for c in completions]


grpo = GRPOTrainer(sft, reward_funcs=[reverse_reward, shorter], reward_weights=[1.0, 0.5],
                   train_dataset=rows, eval_dataset=held_out,
                   args=GRPOConfig(steps=20, prompts_per_step=16, group_size=8, max_new_tokens=8),
                   config={**common, "optim": {"lr": 1e-4, "schedule": "constant"}}, run_dir=ROOT / "grpo",
                   overwrite=True)
assert grpo.model is sft.model  # the same tensors: no copy, no weight sync
summary = grpo.train()
[(e["step"], round(e["reward"], 3)) for e in summary["evals"]]

# %%
grpo.generate(["reverse abc:", "reverse dead:"], max_tokens=8)

# %% [markdown]
# ## Save, reload, serve
# `save` writes an HF folder; `rlfuse serve runs/notebook/grpo` serves the run over the
# OpenAI API (docs/serving.md). The run folders hold metrics.jsonl, config.yaml and the
# rows given here as data/train.jsonl, so `rlfuse report runs/notebook` plots them.

# %%
folder = grpo.save(ROOT / "export")
model, tokenizer = load_model(folder)
sum(p.numel() for p in model.parameters())
