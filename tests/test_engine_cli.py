"""`rlfuse generate` on a saved tiny checkpoint with a character-level tokenizer: greedy
output equals the naive oracle, JSON lines carry ids, text and finish reason."""

import json

import pytest
import torch
from engine_helpers import (
    one_thread,  # noqa: F401 (fixture)
    tiny_model,
)
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from rlfuse.cli import main
from rlfuse.engine.naive import greedy_generate_naive
from rlfuse.model import save_model
from rlfuse.model.lora import LoRAConfig, adapters_off, attach_lora, lora_parameters
from rlfuse.model.lora_peft import save_peft_adapter
from rlfuse.model.tokenizer import Tokenizer

CHARS = [chr(0x100 + i) for i in range(127)]  # ids 0..126; 127 = <eos>


@pytest.mark.parametrize("adapter", [False, True])
def test_generate_cli_json(tmp_path, capsys, adapter):
    """With --adapter: the base folder plus a PEFT adapter folder, generated unmerged."""
    model = tiny_model()
    be = Backend(models.WordLevel({c: i for i, c in enumerate(CHARS)} | {"<eos>": 127}, unk_token=CHARS[0]))
    be.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    be.decoder = decoders.Fuse()
    save_model(model, tmp_path / "m")                  # replaces the folder: tokenizer after
    Tokenizer(be, eos_token="<eos>").save(tmp_path / "m")
    extra = []
    if adapter:
        cfg = LoRAConfig(rank=4)
        attach_lora(model, cfg)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _, p in lora_parameters(model):
                p.normal_(0.0, 0.3, generator=g)
        save_peft_adapter(model, tmp_path / "adapter")
        extra = ["--adapter", str(tmp_path / "adapter")]
    prompt = "".join(CHARS[i] for i in (5, 17, 3, 99))
    rc = main(["--log-level", "WARNING", "generate", str(tmp_path / "m"), "--prompt", prompt, "--max-tokens", "6",
               "--json", "--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "4", *extra])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    (ref,) = greedy_generate_naive(model, [[5, 17, 3, 99]], 6, eos_ids=[127])
    assert len(lines) == 1 and lines[0]["output_token_ids"] == ref
    assert lines[0]["text"] == "".join(CHARS[i] for i in ref if i != 127)
    assert lines[0]["finish_reason"] == ("stop" if ref[-1] == 127 else "length")
    if adapter:
        with adapters_off(model):
            (base,) = greedy_generate_naive(model, [[5, 17, 3, 99]], 6, eos_ids=[127])
        assert base != ref  # the adapter changed the completion
