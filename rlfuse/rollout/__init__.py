"""rlfuse.rollout: producing trajectories on the engine -- multi-turn episodes, chat rendering, environments, tools and the sandbox."""

from rlfuse.rollout.chat import ChatRenderer, TemplateError
from rlfuse.rollout.env import Environment, Step, ToolEnv, ToolRunner, Turn
from rlfuse.rollout.multi_turn import Episode, MultiTurnConfig, run_episodes
from rlfuse.rollout.tools import Tool, ToolError, ToolTimeout, calculator, load_tools

__all__ = ["ChatRenderer", "Environment", "Episode", "MultiTurnConfig", "Step", "TemplateError", "Tool", "ToolEnv",
           "ToolError", "ToolRunner", "ToolTimeout", "Turn", "calculator", "load_tools", "run_episodes"]
