"""A Hugging Face sequence-classification checkpoint as a reward function.

Recipe: `rewards: [{name: reward_model, path: RM_FOLDER, kwargs: {batch_tokens: 8192}}]`.
RM_FOLDER is a Llama / Qwen2 / Qwen3 `*ForSequenceClassification` folder (config.json,
safetensors with `model.*` + `score.weight`, tokenizer.json and a chat template) with one
output (num_labels 1). Each (prompt, completion) becomes the conversation
    [*prompt messages, {"role": "assistant", "content": completion}]
rendered with the reward model's own chat template (add_generation_prompt false) and
tokenized with its own tokenizer; the prompt messages are the row's `messages` column
when it has one (its final assistant turn, the SFT target, dropped), else one user turn
holding the rendered prompt text. The reward is the head's output at the last non-pad
token (`rlfuse.model.scalar_head`, HF's pooling), scored in packed batches of at most
`batch_tokens` tokens under no_grad on the reward model's device.

Asleep when not in use: between calls the reward model holds its weights only -- no
activations, no cache, no gradients (every parameter has requires_grad False).
Test: python -m pytest -q tests/test_reward_model.py
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rlfuse.model import Packed
from rlfuse.model.scalar_head import load_scalar_head_model
from rlfuse.model.tokenizer import Tokenizer
from rlfuse.run import pack_by_tokens

log = logging.getLogger(__name__)


class RewardModelReward:
    """Callable with the reward-function signature: fn(prompts, completions, **columns)."""

    def __init__(self, path: str, *, device: str = "auto", dtype: str = "float32", batch_tokens: int = 8192,
                 max_length: int = 4096, use_chat_template: bool = True):
        """device: auto (cuda if available, as model.device's default), cpu or cuda[:i];
        dtype: float32 | bfloat16 | float16; max_length: longer conversations keep their
        last max_length tokens (the completion's end, where the score is read);
        use_chat_template: false concatenates prompt text and completion (for a reward
        model trained without one)."""
        if not path:
            raise ValueError("reward 'reward_model': give `path`, a *ForSequenceClassification checkpoint folder")
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"reward 'reward_model': path {path!r} is not a folder")
        if batch_tokens < 1 or max_length < 1:
            raise ValueError(f"reward 'reward_model': kwargs.batch_tokens and kwargs.max_length must be >= 1, "
                             f"got {batch_tokens}, {max_length}")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            log.info("reward model %s: device auto -> %s", path, device)
        self.model = load_scalar_head_model(folder, device=device, dtype=dtype).requires_grad_(False)
        if self.model.num_labels != 1:
            raise ValueError(f"{folder / 'config.json'}: num_labels is {self.model.num_labels}; a reward model "
                             f"needs a single output")
        self.tokenizer = Tokenizer.from_pretrained(folder)
        if use_chat_template and self.tokenizer.chat_template is None:
            raise ValueError(f"reward 'reward_model': {folder} has no chat template; add one, or set "
                             f"kwargs.use_chat_template: false to score prompt + completion as plain text")
        self.use_chat_template = use_chat_template
        self.batch_tokens, self.max_length = batch_tokens, max_length
        self.path = str(folder)

    def encode(self, prompt: str, completion: str, messages: list[dict] | None = None) -> list[int]:
        """The token ids the reward model scores for one completion (module docstring)."""
        if not self.use_chat_template:
            ids = self.tokenizer.encode(prompt + completion)
        else:
            if messages:
                turns = list(messages[:-1] if messages[-1].get("role") == "assistant" else messages)
            else:
                turns = [{"role": "user", "content": prompt}]
            conv = [*turns, {"role": "assistant", "content": completion}]
            ids = self.tokenizer.apply_chat_template(conv, add_generation_prompt=False, tokenize=True)
        return ids[-self.max_length:] or [self.tokenizer.pad_token_id or 0]

    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]]) -> list[float]:
        """Scores of token sequences, packed into batches of at most batch_tokens tokens."""
        out: list[float] = []
        dev = self.model.device
        for mb in pack_by_tokens([len(s) for s in seqs], self.batch_tokens):
            ids = torch.tensor([t for i in mb for t in seqs[i]], dtype=torch.long, device=dev)
            scores = self.model.sequence_scores(ids, Packed.from_lengths([len(seqs[i]) for i in mb], dev))
            out += scores[:, 0].tolist()  # host sync: the reward list is a host value
        return out

    def __call__(self, prompts: list[str], completions: list[str], messages=None, **_) -> list[float]:
        msgs = messages if messages is not None else [None] * len(completions)
        return self.score_ids([self.encode(p, c, m) for p, c, m in zip(prompts, completions, msgs)])
