"""DPO: the losses on hand-computed cases, preference data (prompt rows, chat rows, bad
rows, the built-in task), the trainer (cached vs live reference, micro-batching, metrics,
resume) and the `rlfuse dpo` command, on a tiny model on CPU.

    python -m pytest -q tests/test_dpo.py
"""

import json
import math

import pytest
import torch
from train_setup import tiny_cfg, tiny_session

from rlfuse.cli import main
from rlfuse.data.preference import build_preference_pairs
from rlfuse.data.rows import load_rows
from rlfuse.data.tasks import make_split, verify_arithmetic
from rlfuse.run.build import char_tokenizer
from rlfuse.run.config.algorithms import DPOConfig
from rlfuse.run.config.run_config import load_config
from rlfuse.run.config.sections import DataConfig
from rlfuse.train.dpo import DPOStep, dpo_loss, run_dpo
from rlfuse.train.loop import make_optimizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# ---------------------------------------------------------------- the losses
def test_dpo_losses_hand_computed():
    # h = (pi_c - ref_c) - (pi_r - ref_r) = (-1 + 2) - (-3 + 2) = 2; beta = 0.5: beta h = 1
    pi_c = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    pi_r = torch.tensor([-3.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-2.0], dtype=torch.float64)
    sig, h = dpo_loss(pi_c, pi_r, ref, ref, loss="sigmoid", beta=0.5)
    assert h.item() == 2.0 and sig.item() == pytest.approx(math.log1p(math.exp(-1)), abs=1e-12)
    sig.sum().backward()
    # d/d pi_c of -log sigmoid(beta h) = -beta sigmoid(-beta h); the opposite for pi_r
    s = 1 / (1 + math.e)
    assert pi_c.grad.item() == pytest.approx(-0.5 * s) and pi_r.grad.item() == pytest.approx(0.5 * s)
    cons, _ = dpo_loss(pi_c, pi_r, ref, ref, loss="conservative", beta=0.5, label_smoothing=0.1)
    assert cons.item() == pytest.approx(0.9 * math.log1p(math.exp(-1)) + 0.1 * math.log1p(math.e), abs=1e-12)
    ipo, _ = dpo_loss(pi_c, pi_r, ref, ref, loss="ipo", beta=0.5)
    assert ipo.item() == pytest.approx((2 - 1 / (2 * 0.5)) ** 2, abs=1e-12)
    # label smoothing only changes the conservative loss; an unknown loss is an error
    assert dpo_loss(pi_c, pi_r, ref, ref, loss="sigmoid", beta=0.5, label_smoothing=0.1)[0].item() == sig.item()
    with pytest.raises(ValueError, match="dpo loss"):
        dpo_loss(pi_c, pi_r, ref, ref, loss="kto")


@pytest.mark.parametrize("bad,msg", [({"dpo.loss": "kto"}, "dpo.loss"), ({"dpo.beta": 0.0}, "dpo.beta"),
                                     ({"dpo.loss": "conservative"}, "label_smoothing"),
                                     ({"dpo.label_smoothing": 0.1}, "conservative only"),
                                     ({"dpo.reference": "cache"}, "dpo.reference")])
def test_config_errors_name_the_field(bad, msg):
    with pytest.raises(ValueError, match=msg):
        load_config({}, [f"{k}={v}" for k, v in bad.items()])


# ---------------------------------------------------------------- data
def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_prompt_rows_and_chat_rows(tmp_path):
    tok = char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 +=?<>|_\n")
    tok.chat_template = CHATML
    eos = tok.eos_token_ids[0]
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
            {"messages": [{"role": "user", "content": "hi"}], "chosen": "yes",
             "rejected": {"role": "assistant", "content": "no"}},
            {"prompt": "same", "chosen": "x", "rejected": "x"}]
    data = DataConfig(train=_jsonl(tmp_path / "p.jsonl", rows))
    counts = {}
    pairs = build_preference_pairs(load_rows(data), tok, data, DPOConfig(), counts=counts)
    assert counts == {"chosen == rejected": 1} and len(pairs) == 2
    p = pairs[0]
    assert tok.decode(p.prompt) == "1+1=" and p.chosen == tok.encode("2", add_special_tokens=False) + [eos]
    c = pairs[1]
    assert tok.decode(c.prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(c.chosen) == "yes<|im_end|>\n" and tok.decode(c.rejected) == "no<|im_end|>\n"
    (seq_c, n, m), (seq_r, n2, m2) = c.sequences()
    assert m == m2 == () and n == n2 == len(c.prompt) and seq_c[n:] == c.chosen and seq_r[n:] == c.rejected
    # truncation on the response side
    short = build_preference_pairs(load_rows(data), tok, data, DPOConfig(max_seq_len=len(c.prompt) + 2))
    assert [len(x.chosen) for x in short] == [2, 2]


@pytest.mark.parametrize("row,msg", [
    ({"prompt": "a", "chosen": "b"}, "missing field 'rejected'"),
    ({"prompt": "a", "chosen": "b", "rejected": ["x"]}, "field 'rejected' must be a string"),
    ({"messages": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": [1]}, "non-empty list of messages"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "chosen": "b",
      "rejected": "c"}, "must end before the reply"),
])
def test_bad_preference_rows_name_file_line_and_field(tmp_path, row, msg):
    tok = char_tokenizer("abc")
    tok.chat_template = CHATML
    data = DataConfig(train=_jsonl(tmp_path / "bad.jsonl", [row]))
    with pytest.raises(ValueError, match=msg) as e:
        build_preference_pairs(load_rows(data), tok, data, DPOConfig())
    assert "bad.jsonl:1" in str(e.value)


def test_parquet_preference_rows_or_a_clear_error(tmp_path):
    p = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # optional dependency: then the error names it
        p.write_bytes(b"PAR1")
        with pytest.raises(ValueError, match="needs pyarrow"):
            load_rows(DataConfig(train=str(p)))
        return
    pq.write_table(pa.table({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]}), p)
    data = DataConfig(train=str(p))
    pairs = build_preference_pairs(load_rows(data), char_tokenizer("abc"), data, DPOConfig())
    assert len(pairs) == 1


def test_builtin_arithmetic_preference_task():
    rows = make_split("arithmetic_pref", 300, seed=3, digits=2, ops="+-", pad=True)
    plain = make_split("arithmetic", 300, seed=3, digits=2, ops="+-", pad=True)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in plain]  # the same problems
    for r in rows:
        assert r["chosen"] == r["answer"] and verify_arithmetic(r["chosen"], r["answer"])
        assert not verify_arithmetic(r["rejected"], r["answer"])
        assert len(r["rejected"]) == len(r["chosen"]) or "-" in r["prompt"]  # the same form
    assert rows == make_split("arithmetic_pref", 300, seed=3, digits=2, ops="+-", pad=True)


# ---------------------------------------------------------------- the trainer
def _cfg(tmp_path, *overrides):
    return tiny_cfg(tmp_path, "dpo.steps=3", "dpo.batch_size=6", *overrides,
                    data={"train": "builtin:arithmetic_pref", "train_size": 40},
                    rewards=[{"name": "arithmetic"}])


def _trainer(cfg, ses, **kw):
    pairs = build_preference_pairs(ses.train_rows, ses.tokenizer, cfg.data, cfg.dpo)
    return DPOStep(cfg, ses.model, make_optimizer(ses.model, cfg), pairs, **kw)


def test_cached_and_live_reference_agree_and_micro_batching_keeps_the_gradient(tmp_path):
    runs = {}
    for name, ref, budget in (("cached", "precompute", 10_000), ("live", "live", 10_000),
                              ("split", "precompute", 9)):  # 9 tokens: one pair per micro-batch
        cfg = _cfg(tmp_path / name, f"dpo.reference={ref}", f"dpo.micro_batch_tokens={budget}")
        ses = tiny_session(cfg)
        tr = _trainer(cfg, ses)
        assert (tr.ref_cache is None) == (ref == "live")
        ms = [tr.step(s) for s in range(2)]
        runs[name] = (ms, [p.detach().clone() for p in ses.model.parameters()])
    for other in ("live", "split"):
        for a, b in zip(runs["cached"][0], runs[other][0]):
            for k in ("loss", "rewards/margin", "logps/chosen", "grad_norm"):
                assert float(a[k]) == pytest.approx(float(b[k]), rel=1e-4, abs=1e-6), (other, k)
        for a, b in zip(runs["cached"][1], runs[other][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    m0, m1 = runs["cached"][0]
    # step 0: the policy is the reference: margin 0, loss log 2
    assert float(m0["rewards/margin"]) == pytest.approx(0.0, abs=1e-5)
    assert float(m0["loss"]) == pytest.approx(math.log(2), abs=1e-5)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "logps/rejected", "lr", "tokens"):
        assert k in m1
    assert float(m1["rewards/margin"]) == pytest.approx(float(m1["rewards/chosen"]) - float(m1["rewards/rejected"]))


def test_run_dpo_evaluates_resumes_and_continues_identically(tmp_path):
    full = run_dpo(c := _cfg(tmp_path / "full", "checkpoint.every=1"), session=tiny_session(c))
    assert [e["step"] for e in full["evals"]] == [0, 3] and full["steps"] == 3
    pe = full["pair_evals"]  # the eval rows are preference rows: the policy's own pair metrics
    assert pe["num_pairs"] == 20 and set(pe["before"]) == {"pair_accuracy", "logp_margin", "logps/chosen",
                                                            "logps/rejected"}
    assert pe["after"]["logp_margin"] != pe["before"]["logp_margin"]
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["stage"] == "dpo"] == [1, 2, 3]
    cut = _cfg(tmp_path / "cut", "checkpoint.every=1")
    run_dpo(cut, session=tiny_session(cut), stop_after=2)
    resumed = _cfg(tmp_path / "cut", "checkpoint.every=1", "checkpoint.resume=auto")
    res = run_dpo(resumed, session=tiny_session(resumed))
    assert res["steps"] == 3
    assert float(res["history"][-1]["loss"]) == pytest.approx(float(full["history"][-1]["loss"]), abs=1e-6)


def test_cli_dpo_and_reference_from_a_folder(tmp_path, capsys):
    quiet = ["--set", "logging.progress=false", "--set", "logging.tensorboard=false", "--threads", "1"]
    tiny = ["--set", "model.random_init={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
            "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16, max_position_embeddings: 64}",
            "--set", "model.path=", "--set", "model.tokenizer=char", "--set", "data.train_size=40",
            "--set", "data.eval_size=10", "--set", "dpo.steps=2", "--set", "dpo.batch_size=4", *quiet]
    a = tmp_path / "a"
    assert main(["dpo", "arith_dpo", "--run-dir", str(a), *tiny]) == 0
    out = capsys.readouterr().out
    assert "dpo done: 2 steps" in out and "held-out accuracy" in out and "held-out pairs (10): pair_accuracy" in out
    # a second run whose reference is the first run's final weights (dpo.ref_path), kept live
    assert main(["dpo", "arith_dpo", "--run-dir", str(tmp_path / "b"), *tiny, "--set", f"dpo.ref_path={a / 'final'}",
                 "--set", "dpo.reference=live"]) == 0


def test_a_nonfinite_dpo_step_is_skipped(tmp_path, monkeypatch):
    """A NaN loss skips the optimizer step: weights bitwise unchanged, the skip counted (issue 16)."""
    import rlfuse.train.dpo as dpo_mod

    cfg = _cfg(tmp_path)
    ses = tiny_session(cfg)
    tr = _trainer(cfg, ses)
    before = {n: p.detach().clone() for n, p in ses.model.named_parameters()}
    real = dpo_mod.dpo_loss
    monkeypatch.setattr(dpo_mod, "dpo_loss", lambda *a, **k: (lambda l, h: (l * float("nan"), h))(*real(*a, **k)))
    m = tr.step(0)
    assert m["optim/skipped_steps"] == 1.0
    assert all(torch.equal(p, before[n]) for n, p in ses.model.named_parameters())
