"""Server-recorded agents (rollout.agent), and tool episodes (rollout.tools), data-parallel
on CPU (gloo, 2 processes) against one process.

The agent (AGENT, a module file each rank imports) makes two chat calls through the
training process's OpenAI-compatible server: the second sends the first answer back plus
a user turn, so the calls merge into one sample; after an answer of odd length it first
rewrites the history, so the episode splits into two samples (both happen at every step
with the random model). Its reward is returned by the agent (a dict, with an extra logged
number).

One spawned 2-rank job (`_job`) runs, with a DistContext and `sampler_factory=agent_sampler`:
  * GRPO, full fine-tune (FSDP2-sharded: each rank's AgentSampler drives an engine on the
    gathered weights, fused projections on), engine.numerics exact, the mismatch checked
    every step, 2 steps, the held-out evaluation through the agent before and after;
  * GRPO with LoRA (a replica of the model on every rank), 2 steps; each rank then checks
    the replicas are bitwise equal (`check_replicas`) and writes its adapters;
  * PPO, full fine-tune (policy and critic sharded), exact numerics, 2 steps;
  * and, without an agent, GRPO on rlfuse's own tool episodes (rollout.tools: the calculator),
    full fine-tune and LoRA.
This process runs the same five in one process and checks: every logged metric within
TOL (tests/test_distributed_run.py explains the bound; the agent's token and failure
totals are summed over ranks, so they equal the one-process totals); the final weights
within WEIGHT_TOL; exact numerics' mismatch 0 at every step (the logged value is the max
over ranks); every sampled token trained; the two ranks' LoRA adapters bitwise equal.
Run: python -m pytest -q -m slow tests/test_distributed_agents.py -s   (-s prints the differences)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from spawn_ranks import gloo_rank, run_ranks, torch_threads
from test_distributed_kinds import TIMED, _weights_diff, adapters_on_ranks, save_adapters
from test_distributed_run import TOL, WEIGHT_TOL, _max_diff
from train_setup import tiny_cfg

from rlfuse.run.distributed import context as D
from rlfuse.run.metrics import read_metrics
from rlfuse.serve import agent_sampler
from rlfuse.train import open_session, run_grpo, run_ppo

pytest.importorskip("openai")

WORLD = 2
AGENT = '''
async def twice(client, row):
    """Two calls; the second resends the first answer and a user turn (from the task's alphabet)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="rlfuse-policy", messages=messages)
    answer = first.choices[0].message.content or ""
    if len(answer) % 2:  # the history rewritten: the second call does not extend the first (a split)
        messages = [{"role": "user", "content": row["prompt"] + "0"}]
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "1+1="}]
    second = await client.chat.completions.create(model="rlfuse-policy", messages=messages)
    text = second.choices[0].message.content or ""
    return {"reward": float(len(text) % 2 == 0) + 0.1 * len(text), "answer_len": len(text)}
'''
COMMON = ("rollout.max_turns=3", "rollout.max_turn_tokens=4", "rollout.max_total_tokens=48",
          "engine.numerics=exact", "model.kernel_backend=auto", "data.eval_size=4", "checkpoint.save_final=true")
RUNS = {  # name -> (trainer, overrides)
    "grpo": (run_grpo, ("grpo.steps=2", "grpo.group_size=2", "grpo.check_every=1", "grpo.eval_every=0",
                        "engine.fuse_projections=true")),
    "lora": (run_grpo, ("grpo.steps=2", "grpo.group_size=2", "grpo.check_every=1", "grpo.eval_every=0",
                        "model.lora={rank: 4, alpha: 8}", "engine.fuse_projections=false")),
    "ppo": (run_ppo, ("ppo.steps=2", "ppo.prompts_per_step=4", "ppo.samples_per_prompt=2", "ppo.max_new_tokens=4",
                      "ppo.mu=1", "ppo.critic_lr=1e-2", "engine.fuse_projections=false")),
}
STAGE = {"lora": "grpo", "tools": "grpo"}
# rlfuse's own episode loop with a tool (rollout.tools), no agent: the random model calls the
# calculator in some episodes (a malformed call is a tool error, the observation says so)
TOOLS = (run_grpo, ("rollout.tools=[calculator]", "rollout.max_turn_tokens=6", "grpo.steps=2", "grpo.group_size=2",
                    "grpo.check_every=1", "engine.fuse_projections=false"))
TOOL_RUNS = ("tools", "tools_lora")  # full fine-tune, and LoRA (replicas)


def _run(out: Path, name: str, ctx=None) -> None:
    n = 1 if ctx is None else ctx.world_size
    tools = name.startswith("tools")
    trainer, over = TOOLS if tools else RUNS[name]
    agent = () if tools else (f"rollout.agent={out / 'agent.py'}:twice",)
    lora = ("model.lora={rank: 4, alpha: 8}",) if name == "tools_lora" else ()
    cfg = tiny_cfg(out / f"{name}{n}", *agent, *COMMON, *over, *lora)
    res = trainer(cfg, session=open_session(cfg, dist=ctx, sampler_factory=agent_sampler if agent else None))
    if name in ("lora", "tools_lora"):
        save_adapters(ctx, res["model"], out, f"{name}{n}")


def _job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    for name in (*RUNS, *TOOL_RUNS):
        _run(Path(out), name, ctx)
    D.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_agents")
    (out / "agent.py").write_text(AGENT)
    with torch_threads(1):
        for name in (*RUNS, *TOOL_RUNS):
            _run(out, name)
        run_ranks(_job, WORLD, out, "agent")
    return out


def _rows(run_dir: Path) -> list[dict]:
    # rollout/agent_wall_s: a time (the slowest rank's); critic/update_ratio: not measured by the
    # sharded critic's optimizer (tests/test_distributed_ppo.py)
    skip = (*TIMED, "rollout/agent_wall_s", "critic/update_ratio")
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in read_metrics(run_dir)]


@pytest.mark.slow  # one 2-rank job (5 runs) and five one-process runs: ~35 s on 2 cores
@pytest.mark.parametrize("name", list(RUNS))
def test_agents_on_two_ranks_match_one_process(runs, name):
    two, one = _rows(runs / f"{name}2"), _rows(runs / f"{name}1")
    steps = [r for r in two if r["stage"] == STAGE.get(name, name)]
    assert len(steps) == 2
    d, where = _max_diff(two, one)
    dw = adapters_on_ranks(runs, name, WORLD)[2] if name == "lora" else _weights_diff(runs / f"{name}2", runs / f"{name}1")
    print(f"agent {name}: 2 ranks vs 1 process, max |metric diff| {d:.2e} ({where}); final weights {dw:.2e}")
    assert d <= TOL, where
    assert dw <= WEIGHT_TOL
    for r in steps:
        assert r["rollout/agent_calls_per_episode"] == 2.0 and r["rollout/agent_failed_frac"] == 0.0, r
        assert r["rollout/agent_tokens_trained"] == r["rollout/agent_tokens_sampled"] > 0, r
        assert 0 < r["rollout/agent_merged_frac"] < 0.5 and r["rollout/agent_split_samples"] > 0, r  # both kinds
        assert r["mismatch/max_abs"] == 0.0, r  # exact numerics: 0 on every rank (the max over ranks)
        assert r["grad_norm"] > 0, r  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("name", TOOL_RUNS)
def test_tool_episodes_on_two_ranks_match_one_process(runs, name):
    two, one = _rows(runs / f"{name}2"), _rows(runs / f"{name}1")
    steps = [r for r in two if r["stage"] == "grpo"]
    assert len(steps) == 2 and sum(r["rollout/tool_calls_per_episode"] for r in steps) > 0  # a tool ran
    d, where = _max_diff(two, one)
    dw = (adapters_on_ranks(runs, name, WORLD)[2] if name == "tools_lora"
          else _weights_diff(runs / f"{name}2", runs / f"{name}1"))
    print(f"{name}: 2 ranks vs 1 process, max |metric diff| {d:.2e} ({where}); final weights {dw:.2e}")
    assert d <= TOL, where
    assert dw <= WEIGHT_TOL
    assert all(r["mismatch/max_abs"] == 0.0 and r["grad_norm"] > 0 for r in steps)
