"""Rows -> token ids: prompts for RL, SFT examples with their target masks.

Rows are read by rlfuse/data/rows.py.

Sources: `.jsonl` (one object per line), `.json` (a list of objects, or {"data": [...]}),
`.parquet` (needs pyarrow), or `builtin:<task>` (rlfuse.data.tasks: a train split and a
disjoint held-out split). A row is either
  * prompt/answer: `prompt_field` (str), optional `answer_field`, `completion_field` (SFT target);
  * chat: `messages_field`, a list of {"role": str, "content": str or a list of content parts}.
Rows may carry images (content parts, or `images_field` with placeholders: rlfuse/data/media.py);
their prompts hold the expanded image-pad runs and `media` (text-only rows: empty).
Malformed rows raise ValueError naming `file:line` (row number for .json/.parquet) and
the field. Other columns are kept and handed to reward functions (TRL's **columns).

Prompt text: chat rows (and prompt rows when `use_chat_template`) go through the
tokenizer's chat template with add_generation_prompt; otherwise system_prompt +
prompt_template.format(**row). SFT targets: the completion plus EOS for prompt rows; for
chat rows every assistant turn, found by rendering growing prefixes of the conversation.

Checked before training starts: every row is parsed, validated and tokenized. Files that
are missing, empty, not UTF-8 or not JSON name the file (and line). Empty prompts,
prompts over `max_prompt_len` are dropped, counted and logged with a few `file:line`
examples; `max_prompt_len` must leave room for output in the model context (an error at
load otherwise), so no prompt kept fills the context; SFT sequences over the context are
truncated or dropped (counted). Rows holding text the tokenizer cannot represent (ids of
its unknown token, e.g. a character tokenizer meeting a character outside its alphabet)
are counted and warned with a `file:line` example and the characters; when they are most
of the rows it is an error (the model would train on `<unk>`s).

The counts are also run metrics (`stats=`: what rlfuse.train.loop writes once, at step 0,
as the "data" row of metrics.jsonl, TensorBoard `data/...`, and what the report and the
commands' summaries show), per split: `<split>/rows`, `<split>/kept` (truncated rows
count as kept) and `<split>/<action>/<reason>`, where the (action, reason) slugs are
stable names (`rlfuse.run.metrics.DATA_REASONS`).

`PromptStream` hands out rows in a seeded order, epoch after epoch, and resumes from
an integer position (checkpointed).
Test: python -m pytest -q tests/test_data.py
"""

from __future__ import annotations

import dataclasses
import logging
import random

from rlfuse.data.media import VisionData, expand_images, split_images
from rlfuse.engine import MediaItem
from rlfuse.run import DATA_REASONS
from rlfuse.run.config import DataConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Prompt:
    """One RL prompt: token ids, rendered text and the row's other columns."""
    ids: list[int]
    text: str
    columns: dict
    where: str
    media: tuple[MediaItem, ...] = ()
    """The prompt's images (pixels, grid, hash, pad-run offset), in token order; () for text."""


@dataclasses.dataclass(slots=True)
class SFTExample:
    ids: list[int]
    mask: list[bool]
    """True where the token is a training target (completion / assistant tokens; never an image token)."""
    where: str
    media: tuple[MediaItem, ...] = ()


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


def check_prompt_len(cfg: DataConfig, context_len: int) -> None:
    """data.max_prompt_len must leave room for output in the model's context; then every
    prompt kept (at most max_prompt_len tokens) has room, and the rest are dropped as too long."""
    if cfg.max_prompt_len >= context_len:
        raise ValueError(f"data.max_prompt_len ({cfg.max_prompt_len}) does not fit in the model context "
                         f"({context_len} tokens: engine.max_model_len, else the model's max_position_embeddings); "
                         f"expected at most {context_len - 1} so that a prompt leaves room for output")


def _images(row: dict, cfg: DataConfig, where: str, vision: VisionData | None) -> tuple[dict, list]:
    """(the row with string contents and image markers, its images [(field, value)]): rows
    without an images column or content parts are returned as they are."""
    msgs = row.get(cfg.messages_field)
    parts = isinstance(msgs, list) and any(isinstance(m.get("content"), list) for m in msgs)
    if not parts and cfg.images_field not in row:
        return row, []
    row, images = split_images(row, cfg, where)
    if images and vision is None:
        raise ValueError(f"{where}: field {images[0][0]}: the row has images but the model has no vision tower "
                         f"(a text-only model); use an image-text model (a Qwen3.5 folder loads its vision tower "
                         f"unless model.text_only is set) or drop the images")
    return row, images


def _empty_prompt(row: dict, cfg: DataConfig) -> bool:
    if cfg.messages_field in row:
        return not any(m["content"].strip() for m in row[cfg.messages_field] if m["role"] != "assistant")
    return not row[cfg.prompt_field].strip()


class Drops:
    """Rows dropped or truncated, by reason: the stable slug (a DATA_REASONS key), the
    sentence the log shows (with the limits of this run), a few `file:line` examples."""

    def __init__(self):
        self.where: dict[str, list[str]] = {}
        self.text: dict[str, str] = {}

    def add(self, slug: str, text: str, where: str) -> None:
        assert slug in DATA_REASONS, slug
        self.where.setdefault(slug, []).append(where)
        self.text[slug] = text

    def counts(self) -> dict[str, int]:
        """{log sentence: rows}."""
        return {self.text[s]: len(w) for s, w in self.where.items()}

    def report(self, what: str, total: int, kept: int, *, split: str, counts: dict | None,
               stats: dict | None) -> None:
        """Log the drops with examples; fill `counts` ({sentence: rows}) and `stats` (the
        metrics of the module docstring for `split`)."""
        if counts is not None:
            counts.update(self.counts())
        if stats is not None:
            stats.update({f"{split}/rows": total, f"{split}/kept": kept,
                          **{f"{split}/{s}": len(w) for s, w in self.where.items()}})
        if not self.where:
            return
        parts = [f"{len(w)} {self.text[s]} (e.g. {', '.join(w[:3])})" for s, w in self.where.items()]
        log.warning("%s (%d rows): %s", what, total, "; ".join(parts))


class UnknownText:
    """Rows whose ids hold the tokenizer's unknown token: counted, with the characters that
    map to it (each distinct character encoded once)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.unk = tokenizer.token_id("unk_token") if hasattr(tokenizer, "token_id") else None
        self.rows: list[str] = []
        self.chars: dict[str, None] = {}
        self._unknown: dict[str, bool] = {}

    def check(self, where: str, text: str, ids: list[int]) -> None:
        if self.unk is None or self.unk not in ids:
            return
        self.rows.append(where)
        for c in dict.fromkeys(text):
            if c not in self._unknown:
                self._unknown[c] = self.unk in self.tokenizer.encode(c, add_special_tokens=False)
            if self._unknown[c]:
                self.chars[c] = None

    def report(self, what: str, total: int, *, split: str, stats: dict | None) -> None:
        """Warn (a few rows) or raise (most rows); stats `<split>/kept/unknown_tokens`."""
        n = len(self.rows)
        if stats is not None and n:
            stats[f"{split}/kept/unknown_tokens"] = n
        if not n:
            return
        chars = " ".join(repr(c) for c in list(self.chars)[:20]) + (" ..." if len(self.chars) > 20 else "")
        unk = self.tokenizer.special_tokens.get("unk_token")
        text = (f"{what}: {n} of {total} rows hold text the tokenizer cannot represent (encoded as {unk}), e.g. "
                f"{self.rows[0]}; characters: {chars or '(none alone: a combination)'}")
        if 2 * n > total:
            raise ValueError(f"{text}; the model would learn from {unk} tokens: use a tokenizer that covers this "
                             f"text (model.tokenizer), or fix the data")
        log.warning("%s; those rows are kept", text)


def build_prompts(pairs, tokenizer, cfg: DataConfig, split: str = "train", *, context_len: int | None = None,
                  counts: dict | None = None, stats: dict | None = None,
                  vision: VisionData | None = None) -> list[Prompt]:
    """Tokenize every row up front. Dropped, counted and logged with `file:line` examples:
    empty prompts and prompts over data.max_prompt_len tokens. Given `context_len` (the
    model's context), max_prompt_len must leave room for output in it (so no prompt kept
    fills the context). `counts`, if given, receives {reason sentence: number dropped};
    `stats` the data metrics of `split` (module docstring). `vision`: the image model's
    processor and marker ids (None: a text-only model; a row with images is an error)."""
    if context_len is not None:
        check_prompt_len(cfg, context_len)
    out, drops, unknown = [], Drops(), UnknownText(tokenizer)
    for where, row in pairs:
        flat, images = _images(row, cfg, where, vision)
        if not images and _empty_prompt(flat, cfg):
            drops.add("dropped/empty_prompt", "empty", where)
            continue
        text = render_prompt(flat, tokenizer, cfg, where)
        ids = _encode(tokenizer, text, _chat(flat, cfg))
        unknown.check(where, text, ids)
        media = ()
        if images:
            ids, media, _ = expand_images(ids, images, vision, where, cfg.max_prompt_len)
        if not ids:
            drops.add("dropped/empty_prompt", "empty", where)
        elif len(ids) > cfg.max_prompt_len:
            drops.add("dropped/prompt_too_long", f"longer than data.max_prompt_len={cfg.max_prompt_len} tokens",
                      f"{where} ({len(ids)} tokens)")
        else:
            out.append(Prompt(ids, text, row, where, media))
    unknown.report(f"data {split}", len(pairs), split=split, stats=stats)
    drops.report(f"data {split}: dropped prompts", len(pairs), len(out), split=split, counts=counts, stats=stats)
    if not out:
        raise ValueError(f"data {split}: no prompts left of {len(pairs)} rows after the checks above "
                         f"({', '.join(f'{n} {r}' for r, n in drops.counts().items())})")
    return out


def build_sft_examples(pairs, tokenizer, cfg: DataConfig, max_seq_len: int, *, context_len: int | None = None,
                       overlong: str = "truncate", counts: dict | None = None, stats: dict | None = None,
                       split: str = "train", chat_layout=None, vision: VisionData | None = None) -> list[SFTExample]:
    """Tokenize every row up front into (ids, target mask). Sequences longer than
    min(max_seq_len, context_len) are truncated on the completion side (overlong="truncate",
    the default: the prompt and the start of the answer still teach) or dropped
    (overlong="drop"); examples with an empty prompt, a prompt over data.max_prompt_len or
    no target token left are dropped. All counted and logged; `counts` receives
    {reason sentence: rows}, `stats` the data metrics of `split` (module docstring).
    `chat_layout(messages) -> (ids, mask)`: how chat rows are laid out instead of the whole
    template's rendering (a multi-turn recipe's: the rollout's layout, tools included).
    `vision` as in build_prompts; image tokens are never targets."""
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    limit = max_seq_len if context_len is None else min(max_seq_len, context_len)
    limit_src = "sft.max_seq_len" if limit == max_seq_len else "the model context"
    if context_len is not None:
        check_prompt_len(cfg, context_len)
    eos = tokenizer.eos_token_ids[:1]
    out, drops, unknown = [], Drops(), UnknownText(tokenizer)
    for where, row in pairs:
        row, images = _images(row, cfg, where, vision)
        if not images and _empty_prompt(row, cfg):
            drops.add("dropped/empty_prompt", "dropped: empty prompt", where)
            continue
        if cfg.messages_field in row:
            if chat_layout is not None:
                ids, mask = chat_layout(row[cfg.messages_field])
                mask = [bool(m) for m in mask]
            else:
                ids, mask = _chat_sft(row[cfg.messages_field], tokenizer, where)
            n_prompt = mask.index(True) if True in mask else len(ids)
            unknown.check(where, "".join(m["content"] for m in row[cfg.messages_field]), ids)
        else:
            prompt = render_prompt(row, tokenizer, cfg, where)
            p_ids = _encode(tokenizer, prompt, _chat(row, cfg))
            target = row[cfg.completion_field] if cfg.completion_field in row else row[cfg.answer_field]
            c_ids = tokenizer.encode(str(target), add_special_tokens=False) + eos
            ids, mask, n_prompt = p_ids + c_ids, [False] * len(p_ids) + [True] * len(c_ids), len(p_ids)
            unknown.check(where, prompt + str(target), ids)
        media = ()
        if images:
            ids, media, mask = expand_images(ids, images, vision, where, cfg.max_prompt_len, mask)
            n_prompt = mask.index(True) if True in mask else len(ids)
        if n_prompt > cfg.max_prompt_len:
            drops.add("dropped/prompt_too_long",
                      f"dropped: prompt longer than data.max_prompt_len={cfg.max_prompt_len} tokens",
                      f"{where} ({n_prompt} tokens)")
            continue
        if len(ids) > limit:
            if overlong == "drop" or any(m.end > limit for m in media):  # never cut through an image
                drops.add("dropped/sft_too_long", f"dropped: longer than {limit} tokens ({limit_src})",
                          f"{where} ({len(ids)} tokens)")
                continue
            drops.add("truncated/sft_too_long", f"truncated to {limit} tokens ({limit_src})",
                      f"{where} ({len(ids)} tokens)")
            ids, mask = ids[:limit], mask[:limit]
        if any(mask[1:]):  # position 0 is never a target
            out.append(SFTExample(ids, mask, where, media))
        else:
            drops.add("dropped/sft_no_target", f"dropped: no target token within {limit} tokens", where)
    unknown.report(f"sft data {split}", len(pairs), split=split, stats=stats)
    drops.report("sft data", len(pairs), len(out), split=split, counts=counts, stats=stats)
    if not out:
        raise ValueError(f"sft data: no examples left of {len(pairs)} rows after the checks above "
                         f"({', '.join(f'{n} {r}' for r, n in drops.counts().items())})")
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
