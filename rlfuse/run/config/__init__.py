"""Run configuration: the typed dataclasses of a recipe (sections, algorithms, the whole
run), YAML loading with typed `a.b=v` overrides, and the generated key reference."""

from rlfuse.run.config.algorithms import ADV_SCALES, DPO_LOSSES, ESTIMATORS, DPOConfig, GRPOConfig, PPOConfig, SFTConfig
from rlfuse.run.config.io import describe, replace
from rlfuse.run.config.run_config import RunConfig, load_config, save_config
from rlfuse.run.config.sections import (
                                          ON_REWARD_ERROR,
                                          CheckpointConfig,
                                          DataConfig,
                                          LoggingConfig,
                                          ModelSpec,
                                          OptimConfig,
                                          RewardSpec,
)

__all__ = ["ADV_SCALES", "DPO_LOSSES", "ESTIMATORS", "ON_REWARD_ERROR", "CheckpointConfig", "DPOConfig", "DataConfig",
           "GRPOConfig", "LoggingConfig", "ModelSpec", "OptimConfig", "PPOConfig", "RewardSpec", "RunConfig", "SFTConfig",
           "describe", "load_config", "replace", "save_config"]
