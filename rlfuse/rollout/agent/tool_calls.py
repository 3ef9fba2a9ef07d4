"""Tool calls in a model turn's text: the Hermes format and the bare-JSON format.

  hermes : <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>
           (any number per turn; what the Qwen templates render for `tool_calls`)
  json   : the whole turn is one JSON object {"name": ..., "arguments" | "parameters": {...}}
           (Llama-3.1 style custom tool calls)
`arguments` may also be a JSON string holding the object (some models write it so). A
malformed call is not dropped silently: it becomes a parse error the environment reports
back to the model as an observation and counts.
Test: python -m pytest -q tests/test_rollout_tools.py
"""

from __future__ import annotations

import dataclasses
import json
import re

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict


def _call_from_json(body: str, where: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError(f'{where} must be a JSON object with a "name" string')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f'{where}: "arguments" is a string that is not a JSON object') from None
    if not isinstance(args, dict):
        raise ValueError(f'{where}: "arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str, fmt: str) -> tuple[list[ToolCall], list[str]]:
    """(calls, parse errors) in a turn's text; `fmt` "hermes" or "json"."""
    calls, errors = [], []
    if fmt == "hermes":
        for k, m in enumerate(_HERMES.finditer(text)):
            try:
                calls.append(_call_from_json(m.group(1).strip(), f"tool call {k + 1}"))
            except ValueError as e:
                errors.append(str(e))
        tail = text[text.rfind("</tool_call>") + 1:] if "</tool_call>" in text else text
        if "<tool_call>" in tail:
            errors.append("a <tool_call> is not closed with </tool_call>")
        return calls, errors
    if fmt == "json":
        body = text.strip()
        if body.startswith("{"):
            try:
                calls.append(_call_from_json(body, "the tool call"))
            except ValueError as e:
                errors.append(str(e))
        return calls, errors
    raise ValueError(f"tool_call_format must be 'hermes' or 'json', got {fmt!r}")


def format_tool_call(call: ToolCall, fmt: str) -> str:
    """The text a model writes for `call` (SFT transcripts, scripted policies in tests)."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>" if fmt == "hermes" else body
