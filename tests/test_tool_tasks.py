"""The agent demo's own tool tasks (rlfuse demo --agent --task lookup|count), beside the
calculator: rows, tools, rewards and the expert's transcripts. Fast; the learning runs over
3 seeds are the slow test at the end (docs/agents.md, "When GRPO does not help").

    python -m pytest -q tests/test_tool_tasks.py            # fast (< 3 s)
    python -m pytest -q -m slow tests/test_tool_tasks.py    # lookup, seeds 0-2 (~3 min)
"""

import json
import math

import pytest
from train_setup import one_thread

from rlfuse.data import lookup_value, task_alphabet
from rlfuse.data.tasks import make_split
from rlfuse.recipes.agent_demo import TASKS, agent_config, run_agent_demo, tool_transcripts, warm_up_target
from rlfuse.rollout import ChatRenderer, ToolError, char_chat_tokenizer, load_tools
from rlfuse.rollout.agent.tool_calls import parse_tool_calls
from rlfuse.rollout.rewards import arithmetic


def test_lookup_and_count_rows_are_deterministic_distinct_and_disjoint():
    for task, opts in (("lookup", {"length": 4}), ("count", {"length": 8, "letters": "abcde"})):
        rows = make_split(task, 300, seed=3, **opts)
        assert rows == make_split(task, 300, seed=3, **opts)
        prompts = [r["prompt"] for r in rows]
        assert len(set(prompts)) == 300
        held = make_split(task, 100, seed=4, exclude=prompts, **opts)
        assert not {r["prompt"] for r in held} & set(prompts)
    assert make_split("count", 1, seed=0, length=6, letters="ab")[0]["prompt"][1:5] == " in "
    r = make_split("lookup", 1, seed=0)[0]
    assert r["prompt"].endswith("=") and r["answer"] == str(lookup_value(r["prompt"][:-1]))
    assert len({lookup_value(k) for k in ("abcd", "abce", "bbcd", "zzzz")}) == 4  # not a constant
    with pytest.raises(ValueError, match="count task: only 8 distinct"):
        make_split("count", 9, seed=0, length=2, letters="ab")


def test_the_tools_return_what_they_should():
    lookup, count = load_tools(["lookup", "count"])
    assert lookup.call({"key": "qzmk"}) == str(lookup_value("qzmk"))
    assert 0 <= lookup_value("qzmk") <= 999
    assert count.call({"letter": "a", "word": "cabbacaa"}) == "4"
    assert count.call({"letter": "e", "word": "cabbacaa"}) == "0"
    with pytest.raises(ToolError, match="one character"):
        count.call({"letter": "ab", "word": "cabbacaa"})
    with pytest.raises(ValueError, match="built-ins: calculator, lookup, count"):
        load_tools(["nope"])


@pytest.mark.parametrize("task", ["lookup", "count"])
def test_expert_episode_calls_the_tool_and_a_right_answer_scores_1(task):
    cfg = agent_config("ci", seed=0, task=task)
    rows = make_split(cfg.data.train.removeprefix("builtin:"), 20, seed=0, **cfg.data.task)
    tools = load_tools(cfg.rollout.tools)
    tok = char_chat_tokenizer(task_alphabet(task, rows), [t.schema() for t in tools])
    renderer = ChatRenderer(tok, tools=[t.schema() for t in tools])
    examples = tool_transcripts([(i, r) for i, r in enumerate(rows)], renderer, task=task)
    for ex, row in zip(examples, rows):
        text = tok.decode(ex.ids)
        calls, errors = parse_tool_calls(text, "hermes")
        assert not errors and len(calls) == 1 and calls[0].name == TASKS[task][2], text
        # the expert's call returns the answer: the tool, not the model, knows it
        assert tools[0].call(calls[0].arguments) == row["answer"], text
        assert len(ex.ids) <= cfg.rollout.max_total_tokens, text  # the episode fits the rollout
        trained = tok.decode([i for i, m in zip(ex.ids, ex.mask) if m])
        assert row["answer"] in trained and ex.mask[-1], trained  # the answer (and its EOS) is trained
    answers = [r["answer"] for r in rows]
    wrong = [str(int(a) + 1) for a in answers]
    assert arithmetic(None, answers, answers) == [1.0] * 20
    assert arithmetic(None, wrong, answers) == [0.0] * 20
    assert arithmetic(None, ["", "x"], answers[:2]) == [0.0, 0.0]


# the learning runs: ~50-60 s a seed on 2 cores (docs/agents.md's table); margin: 2 standard
# errors of a difference of two accuracies on 200 problems (0.1), on the mean of 3 seeds
@pytest.mark.slow
def test_grpo_helps_on_the_lookup_task_over_3_seeds(tmp_path):
    runs = []
    with one_thread():
        for seed in (0, 1, 2):
            runs.append(run_agent_demo("ci", str(tmp_path / str(seed)), seed=seed, task="lookup", echo=lambda s: None))
    summary = json.dumps([{k: v for k, v in r.items() if k != "grpo_history"} for r in runs])
    margin = 2 * math.sqrt(2) * math.sqrt(0.25 / runs[0]["eval_problems"])
    gain = sum(r["accuracy_grpo"] - r["accuracy_sft"] for r in runs) / 3
    assert gain > margin, summary
    assert all(r["accuracy_grpo"] > r["accuracy_no_tool"] + 3 * margin for r in runs), summary


def test_the_warm_up_target_is_above_guessing():
    # the calculator and lookup: no answer is common, the target stays 0.3; count: writing the
    # most common answer ("1") is right ~34% of the time, so 0.3 proved nothing (docs/agents.md)
    for task in ("calculator", "lookup", "count"):
        cfg = agent_config("ci", seed=0, task=task)
        rows = make_split(cfg.data.train.removeprefix("builtin:"), 4000, seed=0, **cfg.data.task)
        guess, target = warm_up_target(list(enumerate(rows)))
        if task == "count":
            assert 0.3 < guess < 0.4 and target == pytest.approx(guess + 0.3 * (1 - guess)), (guess, target)
        else:
            assert (guess, target) == (0.0, 0.3)


def test_unknown_task_and_harness_with_another_task_are_refused(tmp_path):
    with pytest.raises(ValueError, match="task must be one of"):
        agent_config("ci", task="sort")
    with pytest.raises(ValueError, match="runs the calculator task only"):
        run_agent_demo("ci", str(tmp_path), task="count", harness="openai_loop")
