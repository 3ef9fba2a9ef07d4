"""The agent demo (`rlfuse demo --agent`): a tiny model learns to use a calculator.

Task: the built-in arithmetic task with 3-digit multiplication ("864*394="), which a
0.4M-parameter model cannot learn to do in its head in this budget. With the `calculator`
tool (rollout.tools) an episode is: the model writes a Hermes tool call, the calculator's
result comes back as a 'tool' observation, the model writes the answer; the reward is the
exact answer of the last turn.
  1. SFT warm-up on tool transcripts (the expert's episodes, laid out by the rollout rule
     `ChatRenderer.transcript`) until greedy accuracy with tools on 100 training problems
     reaches SFT_TARGET above guessing and episodes sampled at grpo.temperature beat guessing
     by SAMPLED_TARGET: the model knows the format but copies digits with errors.
  2. GRPO on multi-turn episodes (observation tokens masked) raises held-out accuracy.
  3. The no-tool baseline: the same model size and tokenizer, SFT on the direct answers
     for as many optimizer steps as steps 1 and 2 together, then greedy (it never calls the tool).
Tasks (`task`, each with its own tool; the same model, schedule and stages): calculator
(above), lookup ("qzmk=": the `lookup` tool's value of a random key, a hash no model can
infer for a held-out key) and count ("a in cabbaced": the `count` tool's letter count).
Sizes: ci (the learning test, ~1 min per seed on 2 cores), cpu (the default without CUDA),
gpu (the cpu schedule on the GPU; the default with CUDA).
Run: rlfuse demo --agent [--task lookup]   Test: python -m pytest -q tests/test_agent_learning.py tests/test_tool_tasks.py
"""

from __future__ import annotations

import time
from pathlib import Path

from rlfuse.data import PromptStream, SFTExample, build_prompts
from rlfuse.rollout import ToolCall, evaluate, format_tool_call
from rlfuse.run.config import RunConfig, load_config, replace
from rlfuse.train import SFTStep, make_optimizer, open_session, run_grpo

# max SFT steps, GRPO steps, prompts per step, group size, held-out problems
# (gpu: the cpu schedule on a CUDA device, the same tiny fp32 model: numbers comparable)
_SCHEDULE = {"ci": (200, 16, 16, 8, 200), "cpu": (300, 40, 16, 8, 500), "gpu": (300, 40, 16, 8, 500)}
AGENT_SIZES = tuple(_SCHEDULE)
HARNESSES = ("env", "openai_loop", "agents_sdk", "langgraph")
HARNESS_MODULE = "rlfuse.recipes.agent_harnesses"
# task -> (builtin data task, its options, the tool, the expert's tool arguments for a prompt)
TASKS = {
    "calculator": ("arithmetic", {"digits": 3, "ops": "*"}, "calculator", lambda p: {"expression": p.rstrip("=")}),
    "lookup": ("lookup", {"length": 4}, "lookup", lambda p: {"key": p.rstrip("=")}),
    "count": ("count", {"length": 8, "letters": "abcde"}, "count", lambda p: {"letter": p[0], "word": p[5:]}),
}
SFT_TARGET = 0.3
"""The warm-up stops once greedy accuracy with tools on 100 training problems is this far
from guessing towards 1: guess + SFT_TARGET * (1 - guess) (`warm_up_target`)."""


SAMPLED_TARGET = 0.05
"""...and once the episodes sampled at grpo.temperature on those problems are right this much
more often than guessing: GRPO learns only from groups holding a success and a failure."""


def warm_up_target(rows) -> tuple[float, float]:
    """(guess, target): SFT_TARGET above guessing; `guess` is the share of rows whose answer is the most common
    one, floored to the 100 dev problems' resolution (0 for the calculator and lookup, so
    their target stays 0.3; 0.33 for count, where writing "1" whatever the tool returns was
    already 0.3 and GRPO then had nothing to reinforce: docs/agents.md)."""
    answers = [r["answer"] for _, r in rows]
    guess = int(100 * max(answers.count(a) for a in set(answers)) / len(answers)) / 100
    return guess, round(guess + SFT_TARGET * (1 - guess), 4)


def agent_config(size: str = "cpu", run_dir: str = "runs/agent_demo", seed: int = 0,
                 task: str = "calculator") -> RunConfig:
    if size not in _SCHEDULE:
        raise ValueError(f"agent demo size must be one of {AGENT_SIZES}, got {size!r}")
    if task not in TASKS:
        raise ValueError(f"agent demo task must be one of {tuple(TASKS)}, got {task!r}")
    data_task, options, tool, _ = TASKS[task]
    _, grpo_steps, pps, group, n_eval = _SCHEDULE[size]
    return load_config({
        "seed": seed,
        "model": {"random_init": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                      max_position_embeddings=64, rope_theta=10000.0),
                  "tokenizer": "char", "dtype": "float32", "device": "auto" if size == "gpu" else "cpu"},
        "data": {"train": f"builtin:{data_task}", "task": options, "train_size": 4000,
                 "eval_size": n_eval, "max_prompt_len": 16, "seed": seed},
        "rewards": [{"name": "arithmetic"}],
        "rollout": {"tools": [tool], "max_turns": 3, "max_turn_tokens": 24, "max_total_tokens": 56},
        "optim": {"lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.0, "warmup_steps": 0,
                  "schedule": "constant", "max_grad_norm": 1.0},
        "sft": {"steps": _SCHEDULE[size][0], "batch_size": 64, "micro_batch_tokens": 4096, "max_seq_len": 64},
        # temperature 0.6: at 1.0 a warm-up model at ~30% greedy accuracy almost never samples a
        # whole correct episode (~20 digits to copy), so GRPO's groups carry no signal
        "grpo": {"steps": grpo_steps, "prompts_per_step": pps, "group_size": group, "temperature": 0.6,
                 "loss_type": "grpo", "clip_low": 0.2, "clip_high": 0.28, "mu": 2, "micro_batch_tokens": 8192,
                 "sample_every": 5, "seed": seed},
        "logging": {"run_dir": run_dir, "tensorboard": False, "progress": False},
        "checkpoint": {"every": 0, "save_final": False},
    })


def tool_transcripts(rows, renderer, *, with_tool: bool = True, task: str = "calculator") -> list[SFTExample]:
    """The expert's episodes of the task's rows: call the tool on the problem, answer with its
    result (or, without the tool, answer directly); ids and mask by the rollout rule."""
    _, _, tool, arguments = TASKS[task]
    out = []
    for where, row in rows:
        msgs = [{"role": "user", "content": row["prompt"]}]
        if with_tool:
            call = format_tool_call(ToolCall(tool, arguments(row["prompt"])), "hermes")
            msgs += [{"role": "assistant", "content": call}, {"role": "tool", "content": row["answer"]}]
        ids, mask = renderer.transcript(msgs + [{"role": "assistant", "content": row["answer"]}])
        out.append(SFTExample(ids, [bool(m) for m in mask], where))
    return out


def _sft(ses, cfg: RunConfig, examples, steps: int, stop=None) -> int:
    """SFT on `examples` for up to `steps` optimizer steps; `stop(step)` ends it early."""
    trainer = SFTStep(cfg, ses.model, make_optimizer(ses.model, cfg), PromptStream(examples, seed=cfg.data.seed))
    for step in range(steps):
        trainer.train_step(trainer.stream.take(cfg.sft.batch_size), step)
        if stop is not None and stop(step + 1):
            return step + 1
    return steps


def run_agent_demo(size: str = "cpu", run_dir: str = "runs/agent_demo", *, seed: int = 0,
                   overrides: dict | None = None, echo=print, harness: str = "env", task: str = "calculator") -> dict:
    """`harness`: "env" (rlfuse's own episode loop, rollout.tools) or the name of an agent in
    rlfuse.recipes.agent_harnesses (openai_loop, agents_sdk, langgraph): GRPO and the held-out
    evaluations then run that agent through the training process's server (rollout.agent)."""
    if harness not in HARNESSES:
        raise ValueError(f"agent demo harness must be one of {HARNESSES}, got {harness!r}")
    if harness != "env" and task != "calculator":
        raise ValueError(f"agent demo: the {harness} harness runs the calculator task only, got task {task!r}")
    t0 = time.perf_counter()
    base = agent_config(size, run_dir, seed, task)
    if overrides:
        base = replace(base, **overrides)
    sft_cfg = replace(base, **{"logging.run_dir": str(Path(run_dir) / "sft"), "optim.lr": 2e-3})
    ses = open_session(sft_cfg)
    renderer, rewards = ses.sampler.renderer, ses.rewards()
    echo(f"rlfuse demo --agent ({size}): tiny Qwen3 model ({sum(p.numel() for p in ses.model.parameters()) / 1e6:.2f}M "
         f"params), task {task} with the {TASKS[task][2]} tool, run folder {run_dir}")
    dev = build_prompts(ses.train_rows[:100], ses.tokenizer, sft_cfg.data, "dev")
    dev_acc, dev_sampled = [], []
    guess, target = warm_up_target(ses.train_rows)

    def warm_enough(step):
        # accuracy sits at guessing (0 for the calculator) while the format is learnt, then climbs
        # ~10 points a step: checked every 5 steps from step 20, every step once it left guessing
        started = bool(dev_acc) and dev_acc[-1][1] > guess
        if step < 20 or (step % 5 and not started):
            return False
        acc = evaluate(ses.sampler, dev, rewards, max_new_tokens=0)["accuracy"]
        ses.sampler.sleep()
        dev_acc.append((step, acc))
        if acc < target:
            return False
        # greedy accuracy says little about what GRPO will sample: lookup, seed 1, stopped at
        # greedy 0.31 sampled 0.008 at temperature 0.6; 87% of its groups had equal rewards and
        # GRPO did not help (docs/agents.md, "When GRPO does not help")
        sampled = evaluate(ses.sampler, dev, rewards, max_new_tokens=0, temperature=sft_cfg.grpo.temperature)
        ses.sampler.sleep()
        dev_sampled.append((step, sampled["accuracy"]))
        return sampled["accuracy"] >= guess + SAMPLED_TARGET

    sft_steps = _sft(ses, sft_cfg, tool_transcripts(ses.train_rows, renderer, task=task), sft_cfg.sft.steps, warm_enough)
    t_sft = time.perf_counter() - t0
    echo(f"SFT warm-up on tool transcripts: {sft_steps} steps in {t_sft:.0f} s, accuracy with tools on training "
         f"problems {dev_acc[-1][1] if dev_acc else float('nan'):.3f} (stops at {target:g}), sampled at temperature {sft_cfg.grpo.temperature:g} "
         f"{dev_sampled[-1][1] if dev_sampled else float('nan'):.3f} (stops at {guess + SAMPLED_TARGET:g})")
    grpo_cfg = replace(base, **{"logging.run_dir": str(Path(run_dir) / "grpo")})
    if harness == "env":
        grpo_ses = open_session(grpo_cfg, model=ses.model, tokenizer=ses.tokenizer, sampler=ses.sampler)
    else:  # the same task, the agent's own tool loop talking to the trainer's server
        # optional dependency (the `serve` extra): only the agent harnesses need the server
        from rlfuse.serve import agent_sampler
        grpo_cfg = replace(grpo_cfg, **{"rollout.tools": [], "rollout.agent": f"{HARNESS_MODULE}:{harness}"})
        ses.sampler.sleep()
        grpo_ses = open_session(grpo_cfg, model=ses.model, tokenizer=ses.tokenizer, sampler_factory=agent_sampler)
    res = run_grpo(grpo_cfg, session=grpo_ses)
    before, after = res["evals"][0], res["evals"][-1]
    # the no-tool baseline: a fresh model, direct answers, as many optimizer steps
    base_cfg = replace(sft_cfg, **{"logging.run_dir": str(Path(run_dir) / "no_tool")})
    bses = open_session(base_cfg)
    _sft(bses, base_cfg, tool_transcripts(bses.train_rows, bses.sampler.renderer, with_tool=False, task=task),
         sft_steps + grpo_cfg.grpo.steps)
    no_tool = evaluate(bses.sampler, bses.eval_prompts(), bses.rewards(), max_new_tokens=0)
    bses.sampler.sleep()
    out = {"task": task, "seed": seed, "accuracy_sft": before["accuracy"], "accuracy_grpo": after["accuracy"],
           "accuracy_no_tool": no_tool["accuracy"], "eval_problems": int(before["num_problems"]),
           "sft_steps": sft_steps, "grpo_steps": grpo_cfg.grpo.steps, "sft_dev_accuracy": dev_acc,
           "sft_dev_sampled_accuracy": dev_sampled,
           "time_total_s": time.perf_counter() - t0, "grpo_history": res["history"]}
    echo(f"held-out accuracy ({out['eval_problems']} problems, greedy episodes with the tool): after SFT "
         f"{out['accuracy_sft']:.3f} -> after GRPO {out['accuracy_grpo']:.3f}; no-tool baseline "
         f"({sft_steps + grpo_cfg.grpo.steps} SFT steps on direct answers) {out['accuracy_no_tool']:.3f}; "
         f"total {out['time_total_s']:.0f} s")
    return out
