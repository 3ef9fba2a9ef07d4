"""Rollouts and their scores: the trainer's view of the engine (samplers), rewards and
reward models, and held-out evaluation. Multi-turn episodes (environments, tools, the
sandbox, chat rendering) live here too."""

from rlfuse.rollout.agent.chat import ChatRenderer, TemplateError, char_chat_tokenizer
from rlfuse.rollout.agent.env import Environment, Step, ToolEnv, ToolRunner, Turn
from rlfuse.rollout.agent.multi_turn import Episode, run_episodes
from rlfuse.rollout.agent.tool_calls import ToolCall, format_tool_call
from rlfuse.rollout.agent.tools import PYTHON_TOOL, Tool, ToolError, ToolTimeout, calculator, load_tools
from rlfuse.rollout.evaluate import evaluate, score_samples
from rlfuse.rollout.exactness import PROBE_ROWS, combined_engine, multi_turn_setting
from rlfuse.rollout.exactness import compare as compare_episode_logprobs
from rlfuse.rollout.rewards import PYTHON_REWARD, RewardSet
from rlfuse.rollout.sampler import (
    EngineSampler,
    LengthsSampler,
    MultiTurnSampler,
    Sample,
    Sampler,
    chat_template_text,
    episode_renderer,
    media_kwargs,
)

__all__ = ["PROBE_ROWS", "PYTHON_REWARD", "PYTHON_TOOL", "ChatRenderer", "EngineSampler", "Environment", "Episode",
           "LengthsSampler", "MultiTurnSampler", "RewardSet", "Sample", "Sampler", "Step", "TemplateError", "Tool", "ToolCall",
           "ToolEnv", "ToolError", "ToolRunner", "ToolTimeout", "Turn", "calculator", "char_chat_tokenizer", "chat_template_text", "combined_engine",
           "compare_episode_logprobs", "episode_renderer", "evaluate", "format_tool_call", "load_tools", "media_kwargs",
           "multi_turn_setting", "run_episodes", "score_samples"]
