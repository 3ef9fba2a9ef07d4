"""Datasets: files or built-in tasks -> rows -> token ids for SFT and prompts for RL.

Sources: `.jsonl` (one object per line), `.json` (a list of objects, or {"data": [...]}),
`.parquet` (needs pyarrow), or `builtin:<task>` (rlfuse.train.tasks: a train split and a
disjoint held-out split). A row is either
  * prompt/answer: `prompt_field` (str), optional `answer_field`, `completion_field` (SFT target);
  * chat: `messages_field`, a list of {"role": str, "content": str}.
Malformed rows raise ValueError naming `file:line` (row number for .json/.parquet) and
the field. Other columns are kept and handed to reward functions (TRL's **columns).

Prompt text: chat rows (and prompt rows when `use_chat_template`) go through the
tokenizer's chat template with add_generation_prompt; otherwise system_prompt +
prompt_template.format(**row). Prompts longer than `max_prompt_len` tokens are dropped,
counted and logged. SFT targets: the completion plus EOS for prompt rows; for chat rows
every assistant turn, found by rendering growing prefixes of the conversation.

`PromptStream` hands out rows in a seeded order, epoch after epoch, and resumes from
an integer position (checkpointed).
Test: python -m pytest -q tests/test_data.py
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from pathlib import Path

from rlfuse.train.config import DataConfig
from rlfuse.train.tasks import make_split

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Prompt:
    """One RL prompt: token ids, rendered text and the row's other columns."""
    ids: list[int]
    text: str
    columns: dict
    where: str


@dataclasses.dataclass(slots=True)
class SFTExample:
    ids: list[int]
    mask: list[bool]
    """True where the token is a training target (completion / assistant tokens)."""
    where: str


# ------------------------------------------------------------------ reading rows
def _read_file(path: Path) -> list[tuple[str, dict]]:
    """[(where, row)] from a .jsonl / .json / .parquet file."""
    if not path.exists():
        raise ValueError(f"{path}: no such data file")
    suffix = path.suffix.lower()
    out = []
    if suffix == ".jsonl":
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            out.append((f"{path}:{i}", row))
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a list of rows (or an object with a 'data' list)")
        out = [(f"{path}: row {i}", row) for i, row in enumerate(data)]
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        out = [(f"{path}: row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]
    else:
        raise ValueError(f"{path}: unsupported data file type {suffix!r} (expected .jsonl, .json or .parquet)")
    for where, row in out:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object (a row of fields), got {type(row).__name__}")
    return out


def _check_row(where: str, row: dict, cfg: DataConfig, need_target: bool) -> None:
    mf, pf = cfg.messages_field, cfg.prompt_field
    if mf in row:
        msgs = row[mf]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: field {mf!r} must be a non-empty list of messages")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: field {mf}[{j}] must be an object with string 'role' and 'content'")
        if need_target and not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{where}: field {mf!r} has no assistant message to train on")
        return
    if pf not in row:
        raise ValueError(f"{where}: missing field {pf!r} (or {mf!r}); the row has fields {sorted(row)}")
    if not isinstance(row[pf], str):
        raise ValueError(f"{where}: field {pf!r} must be a string, got {type(row[pf]).__name__}")
    af = cfg.answer_field
    if af in row and not isinstance(row[af], (str, int, float)):
        raise ValueError(f"{where}: field {af!r} must be a string or a number, got {type(row[af]).__name__}")
    if need_target:
        cf = cfg.completion_field if cfg.completion_field in row else af
        if cf not in row:
            raise ValueError(f"{where}: missing field {cfg.completion_field!r} (the SFT target; "
                             f"{af!r} is used when it is absent)")
        if not isinstance(row[cf], (str, int, float)):
            raise ValueError(f"{where}: field {cf!r} must be a string, got {type(row[cf]).__name__}")


def load_rows(cfg: DataConfig, split: str = "train", need_target: bool = False) -> list[tuple[str, dict]]:
    """[(where, row)] of the train or eval split, validated."""
    src = cfg.train if split == "train" else (cfg.eval or (cfg.train if cfg.train.startswith("builtin:") else ""))
    if not src:
        raise ValueError(f"data.{split} is empty: give a .jsonl/.json/.parquet file or builtin:<task>")
    if src.startswith("builtin:"):
        task = src.removeprefix("builtin:")
        # eval first: small and fixed, then train excluding its prompts (disjoint splits)
        ev = make_split(task, cfg.eval_size, seed=cfg.seed + 10007, **cfg.task)
        if split == "eval":
            rows = ev
        else:
            rows = make_split(task, cfg.train_size, seed=cfg.seed, exclude={r["prompt"] for r in ev}, **cfg.task)
        pairs = [(f"{src}[{split} {i}]", r) for i, r in enumerate(rows)]
    else:
        pairs = _read_file(Path(src))
    for where, row in pairs:
        _check_row(where, row, cfg, need_target)
    return pairs


# ------------------------------------------------------------------ rendering
def render_prompt(row: dict, tokenizer, cfg: DataConfig, where: str = "row") -> str:
    mf = cfg.messages_field
    if mf in row:
        msgs = row[mf]
        if msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        if cfg.system_prompt and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": cfg.system_prompt}, *msgs]
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    try:
        text = cfg.prompt_template.format_map(row)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{where}: data.prompt_template {cfg.prompt_template!r} cannot be filled from the "
                         f"row's fields {sorted(row)} ({e!r})") from None
    if cfg.use_chat_template:
        msgs = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + \
               [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    return cfg.system_prompt + text


def _chat(row, cfg) -> bool:
    return cfg.messages_field in row or cfg.use_chat_template


def _encode(tokenizer, text: str, chat: bool) -> list[int]:
    # chat templates write their own BOS; plain text gets the tokenizer's post-processor
    return tokenizer.encode(text, add_special_tokens=not chat)


def build_prompts(pairs, tokenizer, cfg: DataConfig, split: str = "train") -> list[Prompt]:
    out, dropped = [], 0
    for where, row in pairs:
        text = render_prompt(row, tokenizer, cfg, where)
        ids = _encode(tokenizer, text, _chat(row, cfg))
        if len(ids) > cfg.max_prompt_len or not ids:
            dropped += 1
            continue
        out.append(Prompt(ids, text, row, where))
    if dropped:
        log.info("data %s: dropped %d of %d prompts longer than data.max_prompt_len=%d tokens",
                 split, dropped, len(pairs), cfg.max_prompt_len)
    if not out:
        raise ValueError(f"data {split}: no prompts left after the length filter (max_prompt_len={cfg.max_prompt_len})")
    return out


def build_sft_examples(pairs, tokenizer, cfg: DataConfig, max_seq_len: int) -> list[SFTExample]:
    eos = tokenizer.eos_token_ids[:1]
    out, dropped = [], 0
    for where, row in pairs:
        if cfg.messages_field in row:
            ids, mask = _chat_sft(row[cfg.messages_field], tokenizer, where)
            n_prompt = mask.index(True) if True in mask else len(ids)
        else:
            p_ids = _encode(tokenizer, render_prompt(row, tokenizer, cfg, where), _chat(row, cfg))
            target = row[cfg.completion_field] if cfg.completion_field in row else row[cfg.answer_field]
            c_ids = tokenizer.encode(str(target), add_special_tokens=False) + eos
            ids, mask, n_prompt = p_ids + c_ids, [False] * len(p_ids) + [True] * len(c_ids), len(p_ids)
        if n_prompt > cfg.max_prompt_len:
            dropped += 1
            continue
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if any(mask[1:]):  # position 0 is never a target
            out.append(SFTExample(ids, mask, where))
        else:
            dropped += 1
    if dropped:
        log.info("sft data: dropped %d of %d examples (prompt over max_prompt_len=%d or no target token "
                 "within max_seq_len=%d)", dropped, len(pairs), cfg.max_prompt_len, max_seq_len)
    if not out:
        raise ValueError("sft data: no examples left after filtering")
    return out


def _chat_sft(msgs: list[dict], tokenizer, where: str) -> tuple[list[int], list[bool]]:
    """ids of the whole conversation and a mask over the assistant turns' tokens."""
    full = tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=False),
                            add_special_tokens=False)
    mask = [False] * len(full)
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = tokenizer.encode(tokenizer.apply_chat_template(msgs[:k], add_generation_prompt=True),
                                  add_special_tokens=False) if k else []
        upto = tokenizer.encode(tokenizer.apply_chat_template(msgs[:k + 1], add_generation_prompt=False),
                                add_special_tokens=False)
        if full[:len(before)] != before or full[:len(upto)] != upto:
            raise ValueError(f"{where}: the chat template does not render this conversation prefix-stably "
                             f"(turn {k}); cannot locate the assistant tokens")
        for t in range(len(before), len(upto)):
            mask[t] = True
    return full, mask


# ------------------------------------------------------------------ ordering
class PromptStream:
    """Items in a seeded random order (a new permutation each epoch); `position` counts
    items handed out and is all the state a resume needs."""

    def __init__(self, items: list, *, seed: int = 0, shuffle: bool = True):
        if not items:
            raise ValueError("PromptStream: no items")
        self.items, self.seed, self.shuffle = items, seed, shuffle
        self.position = 0
        self._epoch, self._order = -1, []

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            order = list(range(len(self.items)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def take(self, k: int) -> list:
        out = []
        for _ in range(k):
            epoch, i = divmod(self.position, len(self.items))
            out.append(self.items[self._order_for(epoch)[i]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])
