"""Tokenizer: a Hugging Face `tokenizer.json` (the `tokenizers` library) plus the special
tokens, EOS ids and chat template(s) of the checkpoint folder.

Contract (what `transformers.AutoTokenizer` does for a folder with a tokenizer.json):
  * `encode(text, add_special_tokens=True)`: the backend's encode; BOS/EOS come from the
    tokenizer.json post-processor. `add_bos_token`/`add_eos_token` given explicitly (in
    tokenizer_config.json or the constructor) replace that post-processor with one that
    adds exactly those tokens, as transformers' Llama-family tokenizer classes do.
  * named special tokens (bos/eos/pad/unk/sep/cls/mask) missing from the backend's added
    tokens are added as special tokens; `decode(..., skip_special_tokens=True)` drops
    every added token marked special. `clean_up_tokenization_spaces` is applied only to
    non-BPE models (transformers 5 skips it for BPE, where it corrupts text).
  * `eos_token_ids`: generation_config.json's `eos_token_id` (int or list), then
    tokenizer_config.json's `eos_token` if not already there.
  * `pad_token_id`: the pad token, else generation_config's pad_token_id, else the first
    EOS id (logged once: any id works as padding because padded rows are masked).
  * `apply_chat_template`: jinja2 in an `ImmutableSandboxedEnvironment` with trim_blocks,
    lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does
    not HTML-escape, a no-op `{% generation %}` block; variables `messages`, `tools`,
    `documents`, `add_generation_prompt`, the named special tokens, then `**kwargs`.
    Message keys whose value is None are dropped first. Templates come from
    chat_template.jinja (+ additional_chat_templates/*.jinja), which win over
    tokenizer_config.json's `chat_template` (a string or a list of {name, template}).
    `tokenize=True` encodes the rendered text with add_special_tokens=False, so control
    tokens a template writes (<|im_start|>...) must be added tokens of the backend
    (`backend.add_special_tokens([...])` for a tokenizer built in memory). Template
    errors (syntax, `raise_exception`, sandbox violations) raise ValueError, where
    transformers lets jinja2's TemplateError through.

Malformed files raise ValueError naming the file and field. `save(folder)` writes files
that `transformers.AutoTokenizer.from_pretrained(folder)` loads to the same behaviour.
Test: python -m pytest -q tests/test_tokenizer.py
"""

from __future__ import annotations

import functools
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

from rlfuse.model.config import read_json

log = logging.getLogger(__name__)

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """Text <-> ids and chat rendering for one checkpoint; see the module docstring."""

    def __init__(self, backend: Backend, *, special_tokens: dict[str, str] | None = None,
                 bos_token: str | None = None, eos_token: str | None = None, pad_token: str | None = None,
                 chat_template: str | dict[str, str] | None = None,
                 add_bos_token: bool | None = None, add_eos_token: bool | None = None,
                 generation_config: dict | None = None, clean_up_tokenization_spaces: bool = False,
                 source: str = "tokenizer"):
        """`backend` is copied, never mutated. `special_tokens` maps names from SPECIAL_NAMES
        to token strings (`bos_token=` etc. are shorthands for it); `generation_config` is the
        generation_config.json dict (its eos/bos/pad ids are read and `save` writes it back)."""
        self._backend = Backend.from_str(backend.to_str())
        self._backend.no_truncation()
        self._backend.no_padding()
        special_tokens = dict(special_tokens or {})
        for name, tok in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token)):
            if tok is not None:
                special_tokens[name] = tok
        special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        for name, tok in special_tokens.items():
            if name not in SPECIAL_NAMES:
                raise ValueError(f"{source}: unknown special token field {name!r} (expected one of {SPECIAL_NAMES})")
            if not isinstance(tok, str):
                raise ValueError(f"{source}: field {name!r} must be a string, got {tok!r}")
        self.special_tokens = special_tokens
        # like transformers: named special tokens become special added tokens if they are not yet
        added = {t.content for t in self._backend.get_added_tokens_decoder().values()}
        missing = [t for t in dict.fromkeys(special_tokens.values()) if t not in added]
        if missing:
            self._backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        self.chat_template = chat_template
        self.generation_config = dict(generation_config) if generation_config else None
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
        self._source = source
        if add_bos_token is not None or add_eos_token is not None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))

        gen = self.generation_config or {}
        val = gen.get("eos_token_id")
        eos = [] if val is None else (list(val) if isinstance(val, list) else [val])
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in eos):
            raise ValueError(f"{source}: generation_config.json field 'eos_token_id' must be an int or a list of "
                             f"ints, got {val!r}")
        eos_tok = self.token_id("eos_token")
        if eos_tok is not None and eos_tok not in eos:
            eos.append(eos_tok)
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))
        self.bos_token_id: int | None = self.token_id("bos_token")
        if self.bos_token_id is None and isinstance(gen.get("bos_token_id"), int):
            self.bos_token_id = gen["bos_token_id"]
        pad = self.token_id("pad_token")
        if pad is None and isinstance(gen.get("pad_token_id"), int):
            pad = gen["pad_token_id"]
        if pad is None and self.eos_token_ids:
            pad = self.eos_token_ids[0]
            log.info("%s: no pad token; padding with the first EOS id %d (padded rows are masked)", source, pad)
        self.pad_token_id: int | None = pad

    # ---------------------------------------------------------------- loading, saving
    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json, generation_config.json and chat
        template files from an HF checkpoint folder."""
        folder = Path(folder)
        tj = folder / "tokenizer.json"
        if not tj.exists():
            raise ValueError(f"{folder}: no tokenizer.json (only `tokenizers` JSON files are supported)")
        try:
            backend = Backend.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception on parse errors
            raise ValueError(f"{tj}: not a valid tokenizers file ({e})") from None
        cfg_path = folder / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.exists() else {}
        gen_path = folder / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.exists() else None

        special = {name: _token_content(cfg[name], cfg_path, name) for name in SPECIAL_NAMES if cfg.get(name)}
        _add_config_tokens(backend, cfg.get("added_tokens_decoder"), cfg_path)
        flags = {}
        for name in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces"):
            if cfg.get(name) is not None:
                if not isinstance(cfg[name], bool):
                    raise ValueError(f"{cfg_path}: field {name!r} must be true or false, got {cfg[name]!r}")
                flags[name] = cfg[name]
        return cls(backend, special_tokens=special, chat_template=_load_chat_template(folder, cfg, cfg_path),
                   generation_config=gen, source=str(folder), **flags)

    def save(self, folder: str | Path) -> Path:
        """Write tokenizer.json, tokenizer_config.json, chat template file(s) and
        generation_config.json (when known) into `folder` (created if needed)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(folder / "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                               "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
                               "model_max_length": 1 << 30, **self.special_tokens}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
        templates = self.chat_template if isinstance(self.chat_template, dict) else (
            {} if self.chat_template is None else {"default": self.chat_template})
        for name, text in templates.items():
            path = folder / ("chat_template.jinja" if name == "default" else f"additional_chat_templates/{name}.jinja")
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
        if self.generation_config is not None:
            (folder / "generation_config.json").write_text(json.dumps(self.generation_config, indent=2))
        return folder

    # ---------------------------------------------------------------- ids and text
    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids incl. added tokens (the model's embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str) -> int | None:
        """Id of the named special token ("eos_token", ...), None if not set."""
        tok = self.special_tokens.get(name)
        if tok is None:
            return None
        tid = self._backend.token_to_id(tok)
        if tid is None:  # unreachable: __init__ adds named tokens to the backend
            raise ValueError(f"{self._source}: field {name!r} is {tok!r}, which is not in the vocabulary")
        return tid

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and type(self._backend.model).__name__ != "BPE":
            for a, b in _CLEANUPS:
                text = text.replace(a, b)
        return text

    def _set_post_processor(self, bos: bool, eos: bool) -> None:
        """Replace the post-processor by one that adds BOS and/or EOS around each sequence."""
        specials = {}
        for want, name in ((bos, "bos_token"), (eos, "eos_token")):
            if want and self.special_tokens.get(name) is None:
                raise ValueError(f"{self._source}: add_{name} is true but no {name!r} is set")
            if want:
                specials[self.special_tokens[name]] = self.token_id(name)
        b = f"{self.special_tokens['bos_token']}:0 " if bos else ""
        e = f" {self.special_tokens['eos_token']}:0" if eos else ""
        single = f"{b}$A:0{e}"
        pair = f"{single} {b.replace(':0', ':1')}$B:1{e.replace(':0', ':1')}"
        self._backend.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                                   special_tokens=list(specials.items()))

    # ---------------------------------------------------------------- chat
    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template text: a name from the template dict, a template string, or the default."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"{self._source}: several chat templates {sorted(templates)} and none named "
                             "'default'; pass chat_template=<name>")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError(f"{self._source}: no chat template (chat_template.jinja or tokenizer_config.json "
                             "field 'chat_template')")
        return templates

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False,
                            *, chat_template: str | None = None, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, **kwargs) -> str | list[int]:
        """Render `messages` ([{"role", "content", ...}]) to text, or to ids when `tokenize`."""
        template = _compile(self.get_chat_template(chat_template, tools))
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **kwargs}
        try:
            text = template.render(messages=msgs, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"{self._source}: chat template error: {e}") from e
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def chat_prompt_ids(self, messages: list[dict], **kwargs) -> list[int]:
        """The prompt that asks for the next assistant turn after `messages`: the template
        with the generation prompt, encoded without added special tokens (the template
        writes its own). `rlfuse generate --chat` and `rlfuse serve` prompt with this."""
        return self.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)


# -------------------------------------------------------------------- helpers
def _read_json(path: Path) -> dict:
    d = read_json(path)
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level, got {type(d).__name__}")
    return d


def _token_content(v, path: Path, field: str) -> str:
    """A token as a string, or the serialized AddedToken form {"content": ...}."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    raise ValueError(f"{path}: field {field!r} must be a string or an object with a 'content' string, got {v!r}")


def _add_config_tokens(backend: Backend, decoder, path: Path) -> None:
    """Add tokenizer_config.json's added_tokens_decoder entries the backend lacks."""
    if decoder is None:
        return
    if not isinstance(decoder, dict):
        raise ValueError(f"{path}: field 'added_tokens_decoder' must be an object of id -> token")
    have = {t.content for t in backend.get_added_tokens_decoder().values()}
    new = []
    for key, tok in sorted(decoder.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else -1):
        if not str(key).isdigit():
            raise ValueError(f"{path}: field 'added_tokens_decoder' has a non-integer id {key!r}")
        content = _token_content(tok, path, f"added_tokens_decoder.{key}")
        if content in have:
            continue
        opts = {k: bool(tok[k]) for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
                if isinstance(tok, dict) and k in tok}
        new.append(AddedToken(content, **opts))
    for t in new:
        (backend.add_special_tokens if t.special else backend.add_tokens)([t])


def _load_chat_template(folder: Path, cfg: dict, cfg_path: Path) -> str | dict[str, str] | None:
    templates: dict[str, str] = {}
    if (folder / "chat_template.jinja").exists():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    t = cfg.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list) and all(isinstance(x, dict) and isinstance(x.get("name"), str)
                                   and isinstance(x.get("template"), str) for x in t):
        return {x["name"]: x["template"] for x in t}
    raise ValueError(f"{cfg_path}: field 'chat_template' must be a string or a list of "
                     f"{{'name': str, 'template': str}} objects")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; rendering is unchanged, so here it just renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes (no reaching into internals)."""

    def __init__(*args, **kwargs):  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for k in attrs:
            _Namespace._check(k)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: underscore names are not allowed")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson HTML-escapes <, >, &, ' which chat templates must not do
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template: syntax error on line {e.lineno}: {e.message}") from None
