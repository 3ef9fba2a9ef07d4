"""GPU: GRPO steps in bf16 with the fused kernels (auto backend) and CUDA-graph decode:
finite losses, rollout/trainer log-prob agreement within bf16 drift, fp32 masters moving
while the bf16 params follow them in place, KV pool released while training."""

import pytest
import torch
from train_setup import tiny_cfg

from rlfuse.data.prompts import PromptStream, build_prompts
from rlfuse.train.grpo import GRPOStep
from rlfuse.train.loop import make_optimizer
from rlfuse.train.session import open_session

pytestmark = pytest.mark.gpu

MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=128)


def test_grpo_bf16_cuda(tmp_path):
    cfg = tiny_cfg(tmp_path, "model.dtype=bfloat16", "model.device=cuda", "model.kernel_backend=auto",
                   "grpo.prompts_per_step=8", "grpo.group_size=8", "grpo.max_new_tokens=8", "optim.lr=1e-3",
                   "grpo.loss_type=dapo", model={"random_init": MODEL},
                   engine={"gpu_memory_fraction": 0.5, "max_num_seqs": 64})
    ses = open_session(cfg)
    opt = make_optimizer(ses.model, cfg)
    prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data)
    tr = GRPOStep(cfg, ses.model, ses.sampler, ses.rewards(), PromptStream(prompts), opt)
    p = ses.model.model.layers[0].mlp.up_proj.weight
    ptr, w0 = p.data_ptr(), p.detach().clone()
    for step in range(3):
        m = tr.step(step)
        assert torch.isfinite(torch.as_tensor(m["loss"])).item()
        # same kernels for rollout and training; bf16 forward layouts differ (paged vs varlen)
        assert float(m["mismatch/max_abs"]) < 0.1, m["mismatch/max_abs"]
        assert float(m["mismatch/kl_k3"]) < 1e-3, m["mismatch/kl_k3"]
    assert p.data_ptr() == ptr and p.dtype == torch.bfloat16 and not torch.equal(p, w0)
    i = next(j for j, q in enumerate(tr.optimizer.params) if q is p)  # identity: list.index compares values
    assert torch.equal(tr.optimizer.master[i].to(torch.bfloat16), p.detach())  # params = rounded masters
    # the engine sleeps during training: its KV pool does not count against the training phase
    ses.sampler.sleep()
    asleep = torch.cuda.memory_allocated()
    ses.sampler.wake()
    assert torch.cuda.memory_allocated() > asleep
