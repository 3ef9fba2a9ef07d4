"""`rlfuse generate` on a saved tiny checkpoint with a character-level tokenizer: greedy
output equals the naive oracle, JSON lines carry ids, text and finish reason."""

import json

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from engine_helpers import tiny_model
from engine_helpers import one_thread  # noqa: F401 (fixture)
from rlfuse.cli import main
from rlfuse.engine.naive import greedy_generate_naive
from rlfuse.model import save_model
from rlfuse.model.tokenizer import Tokenizer

CHARS = [chr(0x100 + i) for i in range(127)]  # ids 0..126; 127 = <eos>


def test_generate_cli_json(tmp_path, capsys):
    model = tiny_model()
    be = Backend(models.WordLevel({c: i for i, c in enumerate(CHARS)} | {"<eos>": 127}, unk_token=CHARS[0]))
    be.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    be.decoder = decoders.Fuse()
    save_model(model, tmp_path)                  # replaces the folder: tokenizer after
    Tokenizer(be, eos_token="<eos>").save(tmp_path)
    prompt = "".join(CHARS[i] for i in (5, 17, 3, 99))
    rc = main(["--log-level", "WARNING", "generate", str(tmp_path), "--prompt", prompt, "--max-tokens", "6",
               "--json", "--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "4"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    (ref,) = greedy_generate_naive(model, [[5, 17, 3, 99]], 6, eos_ids=[127])
    assert len(lines) == 1 and lines[0]["output_token_ids"] == ref
    assert lines[0]["text"] == "".join(CHARS[i] for i in ref if i != 127)
    assert lines[0]["finish_reason"] == ("stop" if ref[-1] == 127 else "length")
