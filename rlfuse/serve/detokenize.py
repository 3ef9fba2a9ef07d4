"""Text deltas of a growing output for streaming, from token ids.

`IncrementalText.add(ids)` takes the sample's new token ids and returns the text that is
now safe to send. Only a window of the last tokens is decoded per call (the window starts a
few tokens back, so decoders that treat the first token specially, such as a leading
space, see the same context as in a full decode). Text is held back while
  * the window's text ends in U+FFFD: the last token may end inside a multi-byte character;
  * it could be the start of a stop string: the last len(longest stop) - 1 characters.
`finish(final_text)` returns the rest of the engine's final text (cut at a stop string),
so the deltas of a stream always add up to the non-streamed text.
Test: python -m pytest -q tests/test_serve.py -k detok
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class IncrementalText:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, stop: tuple[str, ...] = ()):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0   # window start: tokens before it are decoded into `_text`
        self._read = 0     # tokens up to here are in `_text`
        self._text = ""    # the stable text so far
        self._sent = 0     # characters of `_text` already returned

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, ids: list[int]) -> str:
        """Append new token ids; returns the newly sendable text (maybe "")."""
        self._ids += ids
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._text += now[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        upto = max(len(self._text) - self._hold, self._sent)
        delta, self._sent = self._text[self._sent:upto], upto
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the sample's final text after what `add` returned."""
        sent = self._text[:self._sent]
        if not final_text.startswith(sent):  # a decoder whose text is not prefix-stable
            log.warning("streamed text %r is not a prefix of the final text %r", sent[-40:], final_text[-40:])
        return final_text[len(sent):]
