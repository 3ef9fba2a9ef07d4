"""Reward models: rlfuse's ScalarHeadModel against transformers' *ForSequenceClassification
on tiny random checkpoints of each family, and the `reward_model` reward built on it.

  * scores of a right-padded batch (HF) == ours on the packed unpadded sequences (fp32,
    rel < 1e-5), with sequences that end in the pad id (EOS == pad: HF scores the token
    before) and hold it mid-sequence (HF takes the rightmost non-pad token);
  * a causal-LM folder loads as a critic trunk (head zero), and `from_causal_lm` copies
    the trunk: same hidden states as the policy;
  * the reward: `{name: reward_model, path: ...}` in a RewardSet scores (prompt, completion)
    with the RM's chat template, equal to transformers' score of the same rendered text;
    a messages column replaces the user turn; errors for a causal-LM folder, a missing
    chat template, and `path` on a function reward.
Run: python -m pytest -q tests/test_reward_model.py
"""

import json

import pytest
import torch
import transformers
from tiny_hf import FAMILIES, hf_config, randomize_, rel_err

from rlfuse.kernels import use_backend
from rlfuse.model import Packed, load_model
from rlfuse.model.scalar_head import ScalarHeadModel, last_non_pad_rows, load_scalar_head_model
from rlfuse.model.tokenizer import Tokenizer
from rlfuse.rollout.rewards import RewardSet
from rlfuse.run.build import char_tokenizer
from rlfuse.run.config.sections import RewardSpec

PAD = 0
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
ALPHABET = "<>abcdefghijklmnopqrstuvwxyz0123456789+-=? \n"


def hf_seq_cls(family: str, seed: int = 0):
    cfg = hf_config(family, num_labels=1, pad_token_id=PAD)
    m = transformers.AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager",
                                                                   dtype=torch.float32)
    return randomize_(m, seed).eval()


def rm_folder(tmp_path, family: str, seed: int = 0, template: str | None = TEMPLATE):
    hf = hf_seq_cls(family, seed)
    hf.save_pretrained(tmp_path)
    tok = char_tokenizer(ALPHABET)
    Tokenizer(tok.backend, special_tokens=tok.special_tokens, chat_template=template,
              generation_config=tok.generation_config).save(tmp_path)
    return hf, tmp_path


def _hf_scores(hf, seqs):
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), PAD)
    mask = torch.zeros(len(seqs), S, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)], mask[b, :len(s)] = s, 1
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_match_transformers(tmp_path, family):
    hf, folder = rm_folder(tmp_path, family, seed=FAMILIES.index(family))
    model = load_scalar_head_model(folder, dtype="float32")
    assert model.num_labels == 1 and model.config.pad_token_id == PAD
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 96, (n,), generator=g) for n in (7, 12, 5, 9)]
    seqs[1][-1] = PAD  # ends in the pad id (EOS == pad): HF scores the token before it
    seqs[2][2] = PAD   # pad id mid-sequence: the rightmost non-pad token still counts
    seqs[3][-2:] = PAD
    gold = _hf_scores(hf, seqs)
    with use_backend("torch"), torch.no_grad():
        ours = model.sequence_scores(torch.cat(seqs), Packed.from_lengths([len(s) for s in seqs]))
    assert ours.shape == gold.shape == (4, 1)
    assert rel_err(ours, gold) < 1e-5, (ours, gold)
    # the pooling rule itself changes the answer here: scoring each sequence's last row differs
    with use_backend("torch"), torch.no_grad():
        h = model(torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs]),
                  Packed.from_lengths([len(s) for s in seqs]))
    last = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
    assert rel_err(model.score(h[last]).detach(), gold) > 1e-3


def test_last_non_pad_rows_rule():
    ids = torch.tensor([5, 6, 0, 7, 0, 0, 0, 9])  # sequences [5 6 0] [7 0] [0 0] [9]
    cu = torch.tensor([0, 3, 5, 7, 8], dtype=torch.int32)
    assert last_non_pad_rows(ids, cu, 0).tolist() == [1, 3, 5, 7]  # all-pad: its first row, like HF
    assert last_non_pad_rows(ids, cu, None).tolist() == [2, 4, 6, 7]


def test_critic_from_causal_lm_folder_and_from_policy(tmp_path):
    lm = transformers.AutoModelForCausalLM.from_config(hf_config("qwen2"), attn_implementation="eager",
                                                       dtype=torch.float32)
    randomize_(lm, 3).save_pretrained(tmp_path)
    policy = load_model(tmp_path, dtype="float32")
    critic = load_scalar_head_model(tmp_path, dtype="float32", head="zero")
    copy = ScalarHeadModel.from_causal_lm(policy)
    ids = torch.randint(0, 96, (10,))
    pos, attn = torch.arange(10), Packed.from_lengths([10])
    with use_backend("torch"), torch.no_grad():
        h = policy(ids, pos, attn)
        assert torch.equal(critic(ids, pos, attn), h)
        assert torch.equal(copy(ids, pos, attn), h)
        assert torch.equal(copy.token_values(h), torch.zeros(10))
    assert copy.model.embed_tokens.weight.data_ptr() != policy.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        load_scalar_head_model(tmp_path)  # a reward model must have its head


def test_reward_model_reward_matches_transformers_on_rendered_text(tmp_path):
    hf, folder = rm_folder(tmp_path, "qwen3", seed=5)
    rs = RewardSet([RewardSpec(name="reward_model", path=str(folder), kwargs={"device": "cpu", "batch_tokens": 40})])
    fn = rs.fns[0]
    assert all(not p.requires_grad for p in fn.model.parameters())
    prompts, comps = ["12+5=?", "3+4=?", "99+1=?"], ["17", "8", "100 done"]
    with use_backend("torch"):
        total, per = rs.score(prompts, comps, {})
    tok = Tokenizer.from_pretrained(folder)
    seqs = [torch.tensor(tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                                 add_generation_prompt=False, tokenize=True))
            for p, c in zip(prompts, comps)]
    assert tok.decode(seqs[0].tolist()) == "<user>12+5=?\n<assistant>17\n"
    gold = _hf_scores(hf, seqs)[:, 0]
    assert rel_err(torch.tensor(total), gold) < 1e-5 and per["reward_model"] == total
    # a messages column supplies the prompt turns (its final assistant turn dropped)
    msgs = [[{"role": "system", "content": "add"}, {"role": "user", "content": p},
             {"role": "assistant", "content": "gold"}] for p in prompts]
    with use_backend("torch"):
        total_m, _ = rs.score(prompts, comps, {"messages": msgs})
    ids0 = fn.encode(prompts[0], comps[0], msgs[0])
    assert tok.decode(ids0) == "<system>add\n<user>12+5=?\n<assistant>17\n"
    assert total_m != total


def test_reward_model_errors(tmp_path):
    _, folder = rm_folder(tmp_path / "no_template", "llama", template=None)
    with pytest.raises(ValueError, match="no chat template"):
        RewardSet([RewardSpec(name="reward_model", path=str(folder), kwargs={"device": "cpu"})])
    RewardSet([RewardSpec(name="reward_model", path=str(folder),
                          kwargs={"device": "cpu", "use_chat_template": False})])
    with pytest.raises(ValueError, match="unknown keyword argument 'batch'"):
        RewardSet([RewardSpec(name="reward_model", path=str(folder), kwargs={"batch": 3})])
    with pytest.raises(ValueError, match="give `path`"):
        RewardSet([RewardSpec(name="reward_model")])
    with pytest.raises(ValueError, match="`path` is for model rewards"):
        RewardSet([RewardSpec(name="arithmetic", path=str(folder))])
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        RewardSet([RewardSpec(name="reward_model", path=str(folder),
                              kwargs={"device": "cpu", "use_chat_template": False})])
