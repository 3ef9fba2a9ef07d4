"""The calculator task of `rlfuse demo --agent` written against three agent harnesses, unchanged
apart from the client they are given: `rollout.agent: rlfuse.recipes.agent_harnesses:NAME`.

  openai_loop   a plain `openai` tool-calling loop (chat.completions with `tools`)
  agents_sdk    the OpenAI Agents SDK (`openai-agents`), its chat-completions model
  langgraph     LangGraph's prebuilt ReAct agent over `langchain-openai`'s ChatOpenAI
Each gets a row ({"prompt": "864*394=", "answer": "340416"}), lets the model call the
`calculator` tool, and returns None: the recipe's reward (`arithmetic`) scores the last
answer the model wrote. The harness libraries are the `dev` extra's, imported when an agent runs.
Test: python -m pytest -q tests/test_agent_harnesses.py
"""

from __future__ import annotations

import json

from rlfuse.rollout import calculator

MODEL = "rlfuse-policy"
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calculate(expression: str) -> str:
    """The tool: rlfuse's exact calculator, errors as text (what a model reads back)."""
    try:
        return calculator(expression)
    except Exception as e:  # noqa: BLE001 -- a tool's error is the model's observation
        return f"error: {e}"


async def openai_loop(client, row, max_turns: int = 3):
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(max_turns):
        resp = await client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return None
        for call in msg.tool_calls:
            try:
                args = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError:
                args = {}
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(str(args.get("expression", "")))})
    return None


async def agents_sdk(client, row):
    # optional dependency (the `dev` extra): the OpenAI Agents SDK
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. "12*34".
        """
        return calculate(expression)

    agent = Agent(name="calc", instructions=None, tools=[calculator],
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client))
    await Runner.run(agent, row["prompt"], max_turns=3)
    return None


async def langgraph(client, row):
    # optional dependencies (the `dev` extra): LangGraph and langchain-openai
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return calculate(expression)

    llm = ChatOpenAI(model=MODEL, base_url=str(client.base_url), api_key="rlfuse",
                     http_async_client=client.http_client, max_retries=0)
    graph = create_react_agent(llm, [calculator])
    await graph.ainvoke({"messages": [("user", row["prompt"])]}, {"recursion_limit": 7})
    return None
