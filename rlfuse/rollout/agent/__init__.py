"""Multi-turn, tool-using episodes: chat rendering, tool calls, tools and their sandbox, environments, the episode loop."""

from rlfuse.rollout.agent.chat import ChatRenderer, TemplateError, char_chat_tokenizer
from rlfuse.rollout.agent.env import Environment, Step, ToolEnv, ToolRunner, Turn
from rlfuse.rollout.agent.multi_turn import Episode, episode_seed, run_episodes
from rlfuse.rollout.agent.recording import (
    COUNTED_METRICS,
    AgentSession,
    Call,
    Segment,
    session_metrics,
    split_content,
)
from rlfuse.rollout.agent.sandbox import Sandbox
from rlfuse.rollout.agent.tool_calls import ToolCall, format_tool_call, parse_tool_calls
from rlfuse.rollout.agent.tools import Tool, ToolError, ToolTimeout, calculator, load_tools, python_tool

__all__ = ["COUNTED_METRICS", "AgentSession", "Call", "ChatRenderer", "Environment", "Episode", "Sandbox", "Segment", "Step", "TemplateError", "Tool", "ToolCall", "ToolEnv",
           "ToolError", "ToolRunner", "ToolTimeout", "Turn", "calculator", "char_chat_tokenizer", "format_tool_call",
           "episode_seed", "load_tools", "parse_tool_calls", "python_tool", "run_episodes", "session_metrics",
           "split_content"]
