"""Shared by the server tests: a tiny model folder with a byte-level tokenizer and a ChatML
template, and an in-process uvicorn server on a free 127.0.0.1 port."""

from __future__ import annotations

import socket
import threading
import time

import torch
from chat_templates import SMOLLM2
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from rlfuse.model import CausalLM, ModelConfig, save_model
from rlfuse.model.tokenizer import Tokenizer

EOS = 257  # <|im_end|>


def _byte_chars() -> list[str]:
    """The character ByteLevel writes for each byte 0..255: printable Latin-1 bytes stand for
    themselves, the others take the code points from 256 on, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: ids 0..255 = bytes, 256/257 = <|im_start|>/<|im_end|> (EOS)."""
    be = Backend(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
    be.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    be.decoder = decoders.ByteLevel()
    be.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    return Tokenizer(be, eos_token="<|im_end|>", chat_template=SMOLLM2)


def write_model_folder(folder, seed: int = 0, hybrid: bool = False):
    """A 1-layer Qwen3-style random model (vocab 264) + the byte tokenizer, saved as an HF
    folder. Its LM head favours printable ASCII (rows 32..126 scaled up, other bytes and
    <|im_start|> zeroed, EOS kept), so samples are mostly text that streams token by token
    instead of invalid UTF-8 held back to the end. `hybrid`: rlfuse's tiny Qwen3.5 instead
    (three Gated DeltaNet layers and one gated full-attention layer)."""
    if hybrid:
        from rlfuse.model.arch.qwen3_5 import tiny_hybrid_fields
        cfg = ModelConfig(**tiny_hybrid_fields(vocab_size=264, eos_token_id=EOS, max_position_embeddings=256))
    else:
        cfg = ModelConfig(model_type="qwen3", vocab_size=264, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          qk_norm=True, tie_word_embeddings=False, max_position_embeddings=256, eos_token_id=EOS)
    model = CausalLM(cfg)
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        w = model.lm_head_weight
        keep = w[EOS].clone()
        w[:32].zero_()
        w[127:].zero_()
        w[32:127] *= 4
        w[EOS] = keep
    save_model(model, folder)  # replaces the folder: the tokenizer after
    byte_tokenizer().save(folder)
    return folder


class LocalServer:
    """uvicorn serving `app` in a thread on a socket bound to a free 127.0.0.1 port."""

    def __init__(self, app):
        import uvicorn  # the serve extra; the test module skips without it
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        for _ in range(200):  # bounded: 20 s
            if self.server.started:
                return self
            time.sleep(0.1)
        raise RuntimeError("the test server did not start in 20 s")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()
