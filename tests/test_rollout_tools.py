"""Tools: schemas from typed functions, argument checks, the calculator, tool-call parsing.
Run: python -m pytest -q tests/test_rollout_tools.py
"""

from typing import Literal

import pytest

from rlfuse.rollout.agent.tool_calls import ToolCall, format_tool_call, parse_tool_calls
from rlfuse.rollout.agent.tools import Tool, ToolError, calculator, load_tools


def convert(amount: float, unit: Literal["km", "mi"], digits: int | None = None, tags: list[str] | None = None) -> str:
    """Convert a distance.

    Longer text here is not part of the description.

    Args:
        amount: how far.
        unit: the unit to convert to;
            km or mi.
        digits (int): rounding.
        tags: labels.

    Returns:
        the converted distance.
    """
    return f"{amount} {unit}"


def test_schema_from_signature_and_docstring():
    s = Tool.from_function(convert).schema()
    assert s["function"]["name"] == "convert" and s["function"]["description"] == "Convert a distance."
    p = s["function"]["parameters"]
    assert p["required"] == ["amount", "unit"]
    assert p["properties"]["amount"] == {"type": "number", "description": "how far."}
    assert p["properties"]["unit"] == {"enum": ["km", "mi"], "description": "the unit to convert to; km or mi."}
    assert p["properties"]["digits"]["type"] == "integer"
    assert p["properties"]["tags"] == {"type": "array", "items": {"type": "string"}, "description": "labels."}


def test_bad_functions_and_arguments():
    def nodoc(x: int):
        return x

    def untyped(x):
        """Doc.

        Args:
            x: a value.
        """

    def undocumented(x: int):
        """Doc."""

    for fn, msg in ((nodoc, "docstring"), (untyped, "annotation"), (undocumented, "Args")):
        with pytest.raises(ValueError, match=msg):
            Tool.from_function(fn)
    t = Tool.from_function(convert)
    assert t.call({"amount": 3, "unit": "km"}) == "3 km"
    for args, msg in (({"amount": 3}, "missing"), ({"amount": 3, "unit": "m"}, "'unit' must be"),
                      ({"amount": "3", "unit": "km"}, "'amount' must be"), ({"amount": 1, "unit": "km", "x": 1},
                                                                           "unknown")):
        with pytest.raises(ToolError, match=msg):
            t.call(args)
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        Tool.from_function(lambda_div).call({"x": 0})


def lambda_div(x: int) -> float:
    """Divide one by x.

    Args:
        x: the divisor.
    """
    return 1 / x


def test_calculator_is_exact_and_refuses_code():
    assert calculator("1234 * 5678") == "7006652"
    assert calculator("(2 + 3) ** 2 - 7 // 2 % 3") == "25"
    assert calculator("10 / 4") == "2.5" and calculator("sqrt(16)") == "4"
    assert calculator("123456789 * 987654321") == str(123456789 * 987654321)
    for bad, msg in (("__import__('os').system('true')", "not allowed"), ("x + 1", "not allowed"),
                     ("(1).__class__", "not allowed"), ("9 ** 9 ** 9", "too large"), ("1/0", "division"),
                     ("1 +", "not an arithmetic"), ("1" * 600, "longer")):
        with pytest.raises(ToolError, match=msg):
            calculator(bad)


def test_load_tools_from_builtins_and_files(tmp_path):
    (tmp_path / "mytools.py").write_text('def shout(text: str) -> str:\n    """Upper-case text.\n\n    Args:\n'
                                         '        text: what to shout.\n    """\n    return text.upper()\n')
    tools = load_tools(["calculator", f"{tmp_path}/mytools.py:shout"])
    assert [t.name for t in tools] == ["calculator", "shout"] and tools[1].call({"text": "hi"}) == "HI"
    with pytest.raises(ValueError, match=r"rollout.tools\[0\].*unknown built-in"):
        load_tools(["calc"])
    with pytest.raises(ValueError, match=r"rollout.tools\[0\] .*nope.py:f.: no such file"):
        load_tools([f"{tmp_path}/nope.py:f"])
    with pytest.raises(ValueError, match="has no function 'g'"):
        load_tools([f"{tmp_path}/mytools.py:g"])
    with pytest.raises(ValueError, match="twice"):
        load_tools(["calculator", "calculator"])


def test_parse_hermes_and_json_calls():
    c = ToolCall("calculator", {"expression": "2*3"})
    text = "Let me compute.\n" + format_tool_call(c, "hermes") + "\n" + format_tool_call(c, "hermes")
    assert parse_tool_calls(text, "hermes") == ([c, c], [])
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "hermes") == \
        ([ToolCall("f", {"a": 1})], [])
    calls, errs = parse_tool_calls("<tool_call>{oops}</tool_call> and <tool_call>{\"name\": 1}</tool_call>"
                                   "<tool_call>{", "hermes")
    assert calls == [] and len(errs) == 3 and "not valid JSON" in errs[0] and "not closed" in errs[2]
    assert parse_tool_calls("no calls here", "hermes") == ([], [])
    assert parse_tool_calls('{"name": "f", "parameters": {"a": 1}}', "json") == ([ToolCall("f", {"a": 1})], [])
    assert parse_tool_calls("The answer is 4.", "json") == ([], [])
