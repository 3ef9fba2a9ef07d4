"""Run configuration: the typed dataclasses of a recipe (sections, algorithms, the whole
run), YAML loading with typed `a.b=v` overrides, and the generated key reference."""

from rlfuse.run.config.algorithms import ADV_SCALES, DPO_LOSSES, ESTIMATORS, DPOConfig, GRPOConfig, PPOConfig, SFTConfig
from rlfuse.run.config.io import describe, replace
from rlfuse.run.config.run_config import RunConfig, load_config, save_config
from rlfuse.run.config.sections import (
                                          OBS_TRUNCATION,
                                          ON_REWARD_ERROR,
                                          TOOL_CALL_FORMATS,
                                          CheckpointConfig,
                                          DataConfig,
                                          LoggingConfig,
                                          ModelSpec,
                                          OptimConfig,
                                          RewardSpec,
                                          RolloutConfig,
)

__all__ = ["ADV_SCALES", "DPO_LOSSES", "ESTIMATORS", "OBS_TRUNCATION", "ON_REWARD_ERROR", "TOOL_CALL_FORMATS",
           "CheckpointConfig", "DPOConfig", "DataConfig", "GRPOConfig", "LoggingConfig", "ModelSpec", "OptimConfig",
           "PPOConfig", "RewardSpec", "RolloutConfig", "RunConfig", "SFTConfig", "describe", "load_config", "replace",
           "save_config"]
