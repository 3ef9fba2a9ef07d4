"""Reward functions: built-ins, user functions by path, weights, None, and the error
policy (raise with the failing example, or zero and count)."""

import math
import textwrap

import pytest

from rlfuse.rollout.rewards import RewardError, RewardSet, format_reward, math_accuracy, overlong_penalty, resolve
from rlfuse.run.config.sections import RewardSpec


def test_math_accuracy_with_math_verify():
    comps = ["so the answer is \\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{3}", "no answer here"]
    assert math_accuracy(None, comps, answer=["1/2", "1/2", "1/2", "1/2"]) == [1.0, 1.0, 0.0, 0.0]


def test_format_and_overlong():
    assert format_reward(None, ["<think>a</think> <answer>b</answer>", "<answer>b</answer>"]) == [1.0, 0.0]
    ids = [[0] * 5, [0] * 9, [0] * 11, [0] * 3]
    # max_len 12, buffer 4: free up to 8 tokens, then -(n-8)/4, -1 when truncated
    assert overlong_penalty(None, [""] * 4, ids, [False, False, False, True], max_len=12, buffer=4) == \
        [0.0, -0.25, -0.75, -1.0]


def test_weighted_total_per_function_and_none():
    rs = RewardSet([RewardSpec(name="arithmetic", weight=2.0), RewardSpec(name="format", weight=0.5),
                    RewardSpec(name="length_penalty", weight=1.0, kwargs={"coef": 0.1, "max_len": 10})])
    total, per = rs.score(["1+1="] * 2, ["2", "<think></think><answer>3</answer>"],
                          {"answer": ["2", "2"], "completion_ids": [[5, 1], [5] * 10]})
    assert per == {"arithmetic": [1.0, 0.0], "format": [0.0, 1.0], "length_penalty": [-0.02, -0.1]}
    assert total == pytest.approx([2.0 - 0.02, 0.5 - 0.1])
    assert rs.correctness == "arithmetic"


def _user_module(tmp_path, body):
    p = tmp_path / "myrewards.py"
    p.write_text(textwrap.dedent(body))
    return p


def test_user_function_by_path_with_trl_signature(tmp_path):
    p = _user_module(tmp_path, """
        def shout(prompts, completions, level, **kwargs):
            return [None if lv == 0 else float(c.isupper()) for c, lv in zip(completions, level)]
    """)
    rs = RewardSet([RewardSpec(name=f"{p}:shout")])
    total, per = rs.score(["a", "b", "c"], ["HI", "hi", "HI"], {"level": [1, 1, 0]})
    assert per["shout"][:2] == [1.0, 0.0] and per["shout"][2] != per["shout"][2]  # None -> NaN
    assert total == [1.0, 0.0, 0.0]  # NaN counts 0 in the total


def test_unknown_reward_names():
    with pytest.raises(ValueError, match="not a builtin"):
        resolve("acuracy")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        resolve("no_such_mod:f")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve("math:nope")


def test_raising_reward_names_function_and_example(tmp_path):
    p = _user_module(tmp_path, """
        def picky(prompts, completions, **kwargs):
            return [1.0 / (len(c) - 3) for c in completions]
    """)
    rs = RewardSet([RewardSpec(name=f"{p}:picky")])
    with pytest.raises(RewardError, match=r"(?s)reward function 'picky' raised ZeroDivisionError.*on example 1: "
                                          r"prompt='p1'.*completion='abc'.*on_reward_error: zero"):
        rs.score(["p0", "p1", "p2"], ["abcd", "abc", "abcde"], {})


def test_on_reward_error_zero_scores_failing_examples_only(tmp_path, caplog):
    p = _user_module(tmp_path, """
        def picky(prompts, completions, **kwargs):
            return [1.0 / (len(c) - 3) for c in completions]
    """)
    rs = RewardSet([RewardSpec(name=f"{p}:picky")], on_error="zero")
    total, per = rs.score(["p0", "p1", "p2"], ["abcd", "abc", "abcde"], {})
    assert per["picky"] == [1.0, 0.0, 0.5]
    assert rs.error_counts["picky"] == 1
    assert "scoring 0 (on_reward_error=zero)" in caplog.text


def test_wrong_return_shape_is_an_error_even_with_zero(tmp_path):
    p = _user_module(tmp_path, """
        def short(prompts, completions, **kwargs):
            return [1.0]
    """)
    rs = RewardSet([RewardSpec(name=f"{p}:short")], on_error="zero")
    with pytest.raises(RewardError, match=r"must return a list of 2 numbers \(one per completion\), got list of length 1"):
        rs.score(["a", "b"], ["x", "y"], {})


@pytest.mark.parametrize("bad", ["float('nan')", "float('inf')", "-float('inf')"])
def test_non_finite_reward_is_an_error_naming_function_and_example(tmp_path, bad):
    p = _user_module(tmp_path, f"""
        def odd(prompts, completions, **kwargs):
            return [{bad} if c == "b" else 1.0 for c in completions]
    """)
    rs = RewardSet([RewardSpec(name=f"{p}:odd")])
    with pytest.raises(RewardError, match=r"(?s)reward function 'odd' returned -?(nan|inf) \(expected a finite "
                                          r"number or None\).*on example 1: prompt='p1'.*completion='b'"):
        rs.score(["p0", "p1", "p2"], ["a", "b", "c"], {})
    zero = RewardSet([RewardSpec(name=f"{p}:odd"), RewardSpec(name="length_penalty")], on_error="zero")
    total, per = zero.score(["p0", "p1", "p2"], ["a", "b", "c"], {"completion_ids": [[1]] * 3})
    assert per["odd"] == [1.0, 0.0, 1.0] and all(math.isfinite(t) for t in total)
    assert zero.error_counts == {"odd": 1, "length_penalty": 0}


def test_error_counts_are_per_step_and_pop_resets(tmp_path):
    p = _user_module(tmp_path, """
        def picky(prompts, completions, **kwargs):
            return [1.0 / (len(c) - 3) for c in completions]
    """)
    rs = RewardSet([RewardSpec(name=f"{p}:picky")], on_error="zero")
    rs.score(["p"] * 3, ["abc", "abc", "abcd"], {})
    assert rs.error_counts["picky"] == 2
    rs.score(["p"] * 2, ["abcd", "abc"], {})
    assert rs.error_counts["picky"] == 1  # the latest step's, not the run's
    assert rs.total_error_counts["picky"] == 3
    assert rs.pop_error_counts() == {"picky": 3}
    assert rs.pop_error_counts() == {"picky": 0}


def test_zero_policy_with_every_example_failing_is_an_error(tmp_path):
    p = _user_module(tmp_path, """
        def broken(prompts, completions, answer, **kwargs):
            return [float(a) / 0 for a in answer]
    """)
    rs = RewardSet([RewardSpec(name=f"{p}:broken")], on_error="zero")
    with pytest.raises(RewardError, match=r"reward function 'broken' failed on all 2 examples of this batch, "
                                          r"e\.g\. example 1: raised ZeroDivisionError"):
        rs.score(["a", "b"], ["x", "y"], {"answer": ["1", "2"]})


def test_unknown_or_mistyped_kwargs_of_builtins_are_errors():
    with pytest.raises(ValueError, match=r"reward 'length_penalty': unknown keyword argument 'max_length' in "
                                         r"kwargs \(valid kwargs of 'length_penalty': coef, max_len\)"):
        RewardSet([RewardSpec(name="length_penalty", kwargs={"max_length": 10})])
    with pytest.raises(ValueError, match=r"'arithmetic': unknown keyword argument 'tol'.*valid kwargs of "
                                         r"'arithmetic': none"):
        RewardSet([RewardSpec(name="arithmetic", kwargs={"tol": 0.1})])
    with pytest.raises(ValueError, match=r"reward 'overlong_penalty': kwargs.buffer must be a number, got 'x'"):
        RewardSet([RewardSpec(name="overlong_penalty", kwargs={"buffer": "x"})])
    rs = RewardSet([RewardSpec(name="format", kwargs={"pattern": "^a"})])
    assert rs.score(["p", "p"], ["ab", "ba"], {})[1]["format"] == [1.0, 0.0]


def test_unknown_kwargs_of_a_user_function_without_var_kwargs(tmp_path):
    p = _user_module(tmp_path, """
        def strict(prompts, completions, scale=1.0):
            return [scale] * len(completions)
    """)
    with pytest.raises(ValueError, match=r"unknown keyword argument 'scal'.*valid kwargs of .*strict': scale"):
        RewardSet([RewardSpec(name=f"{p}:strict", kwargs={"scal": 2})])
    assert RewardSet([RewardSpec(name=f"{p}:strict", kwargs={"scale": 2.0})]).score(["p"], ["c"], {})[0] == [2.0]
