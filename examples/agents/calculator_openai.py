"""A plain `openai` tool-calling loop on the calculator task of `rlfuse demo --agent`.

The agent knows nothing of rlfuse: it gets an `openai.AsyncOpenAI` client and a data row
({"prompt": "864*394=", "answer": "340416"}), calls the model with one tool, runs the tool
calls it gets back, and returns None so the recipe's reward (`arithmetic`) scores the last
answer. Train it: rollout.agent: examples/agents/calculator_openai.py:agent
"""

import json

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


def calculate(expression: str) -> str:
    a, op, b = next((expression.partition(o) for o in "*+-" if o in expression), ("", "", ""))
    try:
        x, y = int(a), int(b)
    except ValueError:
        return "error: not a binary integer expression"
    return str({"*": x * y, "+": x + y, "-": x - y}[op])


async def agent(client, row, max_turns: int = 3):
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(max_turns):
        resp = await client.chat.completions.create(model="rlfuse-policy", messages=messages, tools=TOOLS)
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return None  # the recipe's reward functions score this last answer
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(str(args.get("expression", "")))})
    return None
