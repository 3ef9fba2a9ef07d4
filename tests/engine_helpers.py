"""Shared by the engine tests: a tiny random Qwen3-style model and a character tokenizer."""

from __future__ import annotations

import pytest
import torch

from rlfuse.model import CausalLM, ModelConfig

VOCAB = 128


def tiny_model(seed: int = 0, std: float = 0.1, layers: int = 2, dtype=torch.float32, device="cpu",
               eos: int | None = None, vocab: int = VOCAB) -> CausalLM:
    """hidden 64, 4 q / 2 kv heads of 16, vocab 128 (default), qk-norm, untied LM head (a tied random
    model mostly repeats its input token); fp32."""
    cfg = ModelConfig(model_type="qwen3", vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      qk_norm=True, tie_word_embeddings=False, max_position_embeddings=512, eos_token_id=eos)
    m = CausalLM(cfg)
    m.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
    return m.to(device=device, dtype=dtype).eval()


def random_prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


class CharTokenizer:
    """id i <-> the character chr(0x100 + i) (one char per id, bijective); no specials."""

    def __init__(self, eos_token_ids=()):
        self.eos_token_ids = list(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 0x100 for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(0x100 + i) for i in ids)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The engine's CPU path is thousands of tiny ops: intra-op threads cost more than they
    save (measured on a loaded 2-core box: 123 s with 2 threads vs 26 s with 1 for the
    engine tests). Set for the module, restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
