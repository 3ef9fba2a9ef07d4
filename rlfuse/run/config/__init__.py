"""Run configuration: the typed dataclasses of a recipe (sections, algorithms, the whole
run), YAML loading with typed `a.b=v` overrides, and the generated key reference."""

from rlfuse.run.config.algorithms import ADV_SCALES, DPO_LOSSES, ESTIMATORS, DPOConfig, GRPOConfig, PPOConfig, SFTConfig
from rlfuse.run.config.io import describe, replace, to_dict
from rlfuse.run.config.run_config import RunConfig, load_config, save_config
from rlfuse.run.config.sections import (
                                          OBS_TRUNCATION,
                                          ON_REWARD_ERROR,
                                          TOOL_CALL_FORMATS,
                                          WANDB_MODES,
                                          CheckpointConfig,
                                          DataConfig,
                                          DistributedConfig,
                                          LoggingConfig,
                                          MlflowConfig,
                                          ModelSpec,
                                          OptimConfig,
                                          RewardSpec,
                                          RolloutConfig,
                                          WandbConfig,
)

__all__ = ["ADV_SCALES", "DPO_LOSSES", "ESTIMATORS", "OBS_TRUNCATION", "ON_REWARD_ERROR", "TOOL_CALL_FORMATS",
           "WANDB_MODES", "CheckpointConfig", "DPOConfig", "DataConfig", "DistributedConfig", "GRPOConfig", "LoggingConfig", "MlflowConfig",
           "ModelSpec", "OptimConfig", "PPOConfig", "RewardSpec", "RolloutConfig", "RunConfig", "SFTConfig",
           "WandbConfig", "describe", "load_config", "replace", "save_config", "to_dict"]
