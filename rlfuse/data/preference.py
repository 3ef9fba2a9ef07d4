"""Preference data for DPO: rows -> (prompt, chosen, rejected) token ids.

Rows come from `rlfuse.data.prompts.load_rows` (JSONL / JSON / Parquet files or
builtin:arithmetic_pref), in one of two forms:
  * prompt rows: `data.prompt_field` (str) and `dpo.chosen_field` / `dpo.rejected_field`
    (str): prompt rendered as for SFT (template, system prompt, optional chat template),
    response = the text's tokens + EOS (as an SFT completion);
  * chat rows: `data.messages_field` (the conversation before the reply) and chosen /
    rejected as a string (the assistant's reply), an assistant message {role, content}, or
    a list of messages: prompt = the conversation rendered with the generation prompt,
    response = what the chat template adds for the reply (it must render the prompt as a
    prefix of the full conversation, else the row is an error).
Checked before training: wrong types name `file:line` and the field. Dropped, counted and
logged: an empty prompt, a prompt over data.max_prompt_len, chosen == rejected (no
preference: zero gradient), and pairs with no response token within dpo.max_seq_len.
Longer sequences are truncated on the response side.
Image rows (an images column or OpenAI-style image parts, as for SFT and GRPO; `vision` given):
the prompt's image markers are expanded to the model's image-pad runs and both sequences of
the pair carry the prompt's images (`PreferencePair.media`); image tokens are never response
tokens.
Test: python -m pytest -q tests/test_dpo.py
"""

from __future__ import annotations

import dataclasses

from rlfuse.data.media import VisionData, expand_images
from rlfuse.data.prompts import Drops, _chat, _empty_prompt, _encode, _images, render_prompt
from rlfuse.engine import MediaItem
from rlfuse.run.config import DataConfig, DPOConfig


@dataclasses.dataclass(slots=True)
class PreferencePair:
    prompt: list[int]
    chosen: list[int]
    """Response tokens (after the prompt) of the preferred answer."""
    rejected: list[int]
    where: str
    media: tuple[MediaItem, ...] = ()
    """The prompt's images (offsets into `prompt`), shared by both sequences; () for text."""

    def sequences(self) -> list[tuple[list[int], int, tuple[MediaItem, ...]]]:
        """[(ids, n_ctx, media)] of the chosen then the rejected sequence, as `PackedBatch.build` takes them."""
        n = len(self.prompt)
        return [(self.prompt + self.chosen, n, self.media), (self.prompt + self.rejected, n, self.media)]

    @property
    def num_tokens(self) -> int:
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


def _reply_messages(value, where: str, field: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    msgs = [value] if isinstance(value, dict) else value
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs):
        raise ValueError(f"{where}: field {field!r} must be a string, a message {{role, content}} or a "
                         f"non-empty list of messages")
    return msgs


def _chat_response(context: list[dict], reply: list[dict], prompt_ids: list[int], tokenizer, where: str,
                   field: str) -> list[int]:
    full = tokenizer.encode(tokenizer.apply_chat_template(context + reply, add_generation_prompt=False),
                            add_special_tokens=False)
    if full[:len(prompt_ids)] != prompt_ids:
        raise ValueError(f"{where}: the chat template does not render the prompt as a prefix of the "
                         f"conversation with {field!r}; cannot locate the response tokens")
    return full[len(prompt_ids):]


def build_preference_pairs(rows, tokenizer, data: DataConfig, dpo: DPOConfig, *, counts: dict | None = None,
                           stats: dict | None = None, split: str = "train",
                           vision: VisionData | None = None) -> list[PreferencePair]:
    """Tokenize every (where, row) up front (module docstring); `counts` receives {reason: dropped},
    `stats` the data metrics of `split` (rlfuse.data.prompts); `vision` as in build_prompts."""
    eos = tokenizer.eos_token_ids[:1]
    out: list[PreferencePair] = []
    drops = Drops()
    for where, row in rows:
        for f in (dpo.chosen_field, dpo.rejected_field):
            if f not in row:
                raise ValueError(f"{where}: missing field {f!r} (a preference row needs {dpo.chosen_field!r} and "
                                 f"{dpo.rejected_field!r}); the row has fields {sorted(row)}")
        row, images = _images(row, data, where, vision)
        prompt_text = render_prompt(row, tokenizer, data, where)
        p_ids = _encode(tokenizer, prompt_text, _chat(row, data))
        resp = []
        for f in (dpo.chosen_field, dpo.rejected_field):
            if data.messages_field in row:
                context = list(row[data.messages_field])
                if context[-1]["role"] == "assistant":
                    raise ValueError(f"{where}: field {data.messages_field!r} must end before the reply "
                                     f"(its last message is the assistant's); the replies belong in "
                                     f"{dpo.chosen_field!r} and {dpo.rejected_field!r}")
                if data.system_prompt and context[0]["role"] != "system":
                    context = [{"role": "system", "content": data.system_prompt}, *context]
                resp.append(_chat_response(context, _reply_messages(row[f], where, f), p_ids, tokenizer, where, f))
            else:
                if not isinstance(row[f], (str, int, float)) or isinstance(row[f], bool):
                    raise ValueError(f"{where}: field {f!r} must be a string (prompt rows), got "
                                     f"{type(row[f]).__name__}")
                resp.append(tokenizer.encode(str(row[f]), add_special_tokens=False) + eos)
        media = ()
        if images:  # after the responses: a chat response is located against the unexpanded prompt
            p_ids, media, _ = expand_images(p_ids, images, vision, where, data.max_prompt_len)
        reason = None
        if not images and _empty_prompt(row, data):
            reason = ("dropped/empty_prompt", "empty prompt")
        elif len(p_ids) > data.max_prompt_len:
            reason = ("dropped/prompt_too_long", f"prompt longer than data.max_prompt_len={data.max_prompt_len} tokens")
        elif resp[0] == resp[1]:
            reason = ("dropped/dpo_same_responses", "chosen == rejected")
        elif len(p_ids) >= dpo.max_seq_len:
            reason = ("dropped/dpo_no_response_room", f"no response token within dpo.max_seq_len={dpo.max_seq_len}")
        if reason:
            drops.add(*reason, where)
            continue
        room = dpo.max_seq_len - len(p_ids)
        out.append(PreferencePair(p_ids, resp[0][:room], resp[1][:room], where, media))
    drops.report("preference data: dropped pairs", len(rows), len(out), split=split, counts=counts, stats=stats)
    if not out:
        raise ValueError(f"preference data: no pairs left of {len(rows)} rows after the checks above")
    return out
