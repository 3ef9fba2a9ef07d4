"""Rollouts and their scores: the trainer's view of the engine (samplers), rewards and
reward models, and held-out evaluation. Multi-turn episodes (environments, tools, the
sandbox, chat rendering) live here too."""

from rlfuse.rollout.evaluate import evaluate, score_samples
from rlfuse.rollout.rewards import PYTHON_REWARD, RewardSet
from rlfuse.rollout.sampler import EngineSampler, Sample, Sampler

__all__ = ["PYTHON_REWARD", "EngineSampler", "RewardSet", "Sample", "Sampler", "evaluate", "score_samples"]
