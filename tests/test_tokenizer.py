"""rlfuse.model.tokenizer against `transformers.AutoTokenizer` on tokenizers built in memory.

A byte-level BPE trained here on a small corpus (ChatML and Llama-3 control tokens added)
and a word-level tokenizer with a whitespace decoder (non-BPE: exercises
clean_up_tokenization_spaces). Each Tokenizer is saved with `save()` and loaded by
transformers, so "transformers loads what we save" and "we agree with transformers" are
checked at once. SmolLM2's real tokenizer is compared in tests/test_smollm2.py (slow).
Run: python -m pytest -q tests/test_tokenizer.py
"""

import json
from datetime import datetime

import pytest
import transformers
from chat_templates import LLAMA3_LIKE, QWEN_LIKE, SMOLLM2, bpe_backend
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from rlfuse.model.tokenizer import Tokenizer

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>",
           "<|start_header_id|>", "<|end_header_id|>"]
CORPUS = ["The capital of France is Paris.", "What is 12 + 30? It is 42.", "def f(x):\n    return x * 2",
          "Tokenizers split text into pieces; pieces map to ids.", "Ünïcödé, emoji 🙂 and tabs\there.",
          "You are a careful assistant. Answer briefly, don't ramble!"] * 4
TEXTS = ["Hello world", " leading space", "The capital of France is Paris.", "<|im_start|>user\nhi<|im_end|>",
         "numbers 1234567 and 3.14", "Ünïcödé 🙂 text", "", "a  b\n\n  c\t", "don't , stop . now ?"]
MESSAGES = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": " Hi there "}],
    "multi": [{"role": "system", "content": "Sys."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4", "tool_calls": None},
              {"role": "user", "content": "and <b>3+3</b> & more?"}],
}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> numbers & more",
                                           "parameters": {"a": "int", "b": "int"}}}]


@pytest.fixture(scope="module")
def bpe():
    return bpe_backend(CONTROL, CORPUS)


def _pair(tok: Tokenizer, tmp_path):
    """(ours reloaded from its own save, transformers' AutoTokenizer on the same folder)."""
    tok.save(tmp_path)
    return Tokenizer.from_pretrained(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("add_bos", [None, True])
def test_encode_decode_match_transformers(bpe, tmp_path, add_bos):
    tok = Tokenizer(bpe, bos_token="<|begin_of_text|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                    add_bos_token=add_bos)
    ours, hf = _pair(tok, tmp_path)
    for t in TEXTS:
        for special in (True, False):
            ids = ours.encode(t, add_special_tokens=special)
            assert ids == tok.encode(t, add_special_tokens=special)
            assert ids == hf.encode(t, add_special_tokens=special), (t, special)
        ids = ours.encode(t) + [ours.eos_token_ids[0]]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    bos = ours.bos_token_id
    assert (ours.encode("Hi")[0] == bos) == bool(add_bos) and ours.encode("Hi", add_special_tokens=False)[0] != bos
    assert ours.vocab_size == len(hf) == bpe.get_vocab_size()
    assert ours.eos_token_ids == [hf.eos_token_id] and ours.pad_token_id == hf.pad_token_id


def test_cleanup_spaces_non_bpe_matches_transformers(tmp_path):
    words = ["[UNK]", "<eos>", "don", "'t", ",", "stop", ".", "now", "?", "it", "'s"]
    wl = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wl.decoder = decoders.WordPiece(cleanup=False)  # joins words with spaces, no clean-up of its own
    for clean in (False, True):
        folder = tmp_path / str(clean)
        ours, hf = _pair(Tokenizer(wl, eos_token="<eos>", clean_up_tokenization_spaces=clean), folder)
        ids = ours.encode("don 't , stop . it 's now ? zzz <eos>")
        assert ids == hf.encode("don 't , stop . it 's now ? zzz <eos>")
        text = ours.decode(ids, skip_special_tokens=True)
        assert text == hf.decode(ids, skip_special_tokens=True)
        assert text == ("don 't, stop. it's now? [UNK]" if clean else "don 't , stop . it 's now ? [UNK]")


@pytest.mark.parametrize("name,template", [("smollm2", SMOLLM2), ("qwen", QWEN_LIKE), ("llama3", LLAMA3_LIKE)])
@pytest.mark.parametrize("gen", [True, False])
def test_chat_templates_match_transformers(bpe, tmp_path, name, template, gen):
    tok = Tokenizer(bpe, bos_token="<|begin_of_text|>", eos_token="<|im_end|>", chat_template=template)
    ours, hf = _pair(tok, tmp_path)
    for key, msgs in MESSAGES.items():
        extra = {"date_string": "26 Jul 2024"} if name == "llama3" else {}
        text = ours.apply_chat_template(msgs, add_generation_prompt=gen, **extra)
        assert text == hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False, **extra), key
        ids = ours.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, **extra)
        assert ids == hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, return_dict=False,
                                             **extra)
        assert ids == ours.encode(text, add_special_tokens=False)
    if name == "qwen":  # tools through tojson: no HTML escaping, same as transformers
        text = ours.apply_chat_template(MESSAGES["user"], tools=TOOLS)
        assert '"Add <two> numbers & more"' in text
        assert text == hf.apply_chat_template(MESSAGES["user"], tools=TOOLS, tokenize=False,
                                              add_generation_prompt=True)
        calls = MESSAGES["user"] + [
            {"role": "assistant", "content": None, "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]},
            {"role": "tool", "content": "3"}, {"role": "assistant", "content": "It is 3."}]
        text = ours.apply_chat_template(calls, add_generation_prompt=gen, tools=TOOLS)
        assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}' in text
        assert text.count("<!--after last user-->") == 2
        assert text == hf.apply_chat_template(calls, tools=TOOLS, tokenize=False, add_generation_prompt=gen)


def test_llama3_template_date_and_raise_exception(bpe):
    tok = Tokenizer(bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA3_LIKE)
    before = datetime.now().strftime("%d %b %Y")
    text = tok.apply_chat_template(MESSAGES["user"])
    after = datetime.now().strftime("%d %b %Y")
    assert text.startswith("<|begin_of_text|>") and (f"Today Date: {before}" in text or f"Today Date: {after}" in text)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.apply_chat_template(bad)


def test_sandbox_blocks_unsafe_templates(bpe):
    tok = Tokenizer(bpe, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="underscore"):
        tok.apply_chat_template([], chat_template="{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES["user"])
    with pytest.raises(ValueError, match="syntax error"):
        tok.apply_chat_template(MESSAGES["user"], chat_template="{% for m in messages %}")


def test_named_templates_from_config_list_and_files(bpe, tmp_path):
    """tokenizer_config.json's list-of-named-templates form, and chat_template.jinja +
    additional_chat_templates/*.jinja (which win over the config), as transformers reads them."""
    Tokenizer(bpe, eos_token="<|im_end|>").save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": SMOLLM2}, {"name": "tool_use", "template": QWEN_LIKE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer.from_pretrained(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.chat_template == {"default": SMOLLM2, "tool_use": QWEN_LIKE}
    for kw in ({}, {"tools": TOOLS}, {"chat_template": "tool_use"}):
        assert ours.apply_chat_template(MESSAGES["system"], **kw) == hf.apply_chat_template(
            MESSAGES["system"], tokenize=False, add_generation_prompt=True, **kw)
    # files override the config; a round trip through save keeps the names
    ours2 = Tokenizer(bpe, eos_token="<|im_end|>", chat_template={"default": LLAMA3_LIKE, "qwen": QWEN_LIKE})
    ours2.save(tmp_path)
    assert (tmp_path / "additional_chat_templates" / "qwen.jinja").exists()
    back, hf = Tokenizer.from_pretrained(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert back.chat_template == {"default": LLAMA3_LIKE, "qwen": QWEN_LIKE} == hf.chat_template
    msgs = MESSAGES["user"]
    assert back.apply_chat_template(msgs, chat_template="qwen") == hf.apply_chat_template(
        msgs, chat_template="qwen", tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="none named 'default'"):
        Tokenizer(bpe, chat_template={"a": SMOLLM2, "b": QWEN_LIKE}).apply_chat_template(msgs)


def test_eos_ids_union_and_pad_fallback(bpe, tmp_path):
    Tokenizer(bpe, eos_token="<|im_end|>").save(tmp_path)
    im_end, eot = bpe.token_to_id("<|im_end|>"), bpe.token_to_id("<|eot_id|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, im_end]}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == [eot, im_end]  # generation_config order, no duplicates
    assert tok.pad_token_id == eot  # no pad token anywhere: first EOS id
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eot, "pad_token_id": 0}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == [eot, im_end] and tok.pad_token_id == 0
    tok.save(tmp_path / "again")
    assert Tokenizer.from_pretrained(tmp_path / "again").eos_token_ids == [eot, im_end]


def test_added_tokens_decoder_and_special_token_objects(bpe, tmp_path):
    Tokenizer(bpe).save(tmp_path)
    cfg = {"eos_token": {"content": "<|im_end|>", "__type": "AddedToken"}, "pad_token": "<pad>",
           "added_tokens_decoder": {str(bpe.get_vocab_size()): {"content": "<tool>", "special": False}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer.from_pretrained(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.vocab_size == len(hf) == bpe.get_vocab_size() + 2  # <tool> and the new <pad>
    for t in ("x <tool> y <pad>", "<|im_end|><pad>"):
        assert ours.encode(t) == hf.encode(t)
        assert ours.decode(ours.encode(t), skip_special_tokens=True) == hf.decode(hf.encode(t),
                                                                                 skip_special_tokens=True)
    assert ours.pad_token_id == hf.pad_token_id and ours.eos_token_ids == [hf.eos_token_id]


@pytest.mark.parametrize("file,content,pattern", [
    ("tokenizer.json", "{broken", r"tokenizer\.json: not a valid tokenizers file"),
    ("tokenizer_config.json", "[1, 2", r"tokenizer_config\.json: not valid JSON"),
    ("tokenizer_config.json", "[1, 2]", r"tokenizer_config\.json: expected a JSON object"),
    ("tokenizer_config.json", '{"eos_token": 5}', r"tokenizer_config\.json: field 'eos_token'"),
    ("tokenizer_config.json", '{"chat_template": 5}', r"tokenizer_config\.json: field 'chat_template'"),
    ("tokenizer_config.json", '{"chat_template": [{"name": "x"}]}', r"field 'chat_template'"),
    ("tokenizer_config.json", '{"add_bos_token": "yes"}', r"tokenizer_config\.json: field 'add_bos_token'"),
    ("tokenizer_config.json", '{"added_tokens_decoder": [1]}', r"field 'added_tokens_decoder'"),
    ("tokenizer_config.json", '{"added_tokens_decoder": {"x": {"content": "a"}}}', r"non-integer id 'x'"),
    ("generation_config.json", '{"eos_token_id": "2"}', r"field 'eos_token_id'"),
    ("generation_config.json", "nope", r"generation_config\.json: not valid JSON"),
])
def test_malformed_files_name_file_and_field(bpe, tmp_path, file, content, pattern):
    Tokenizer(bpe, eos_token="<|im_end|>").save(tmp_path)
    (tmp_path / file).write_text(content)
    with pytest.raises(ValueError, match=pattern):
        Tokenizer.from_pretrained(tmp_path)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_backend_not_mutated(bpe):
    before = bpe.to_str()
    tok = Tokenizer(bpe, bos_token="<new_bos>", add_bos_token=True)
    assert bpe.to_str() == before
    assert tok.encode("a")[0] == tok.bos_token_id == bpe.get_vocab_size()
