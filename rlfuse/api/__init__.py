"""rlfuse.api: the Python API (scripts, notebooks), the layer the command line and the server stand on."""

from rlfuse.api.config import load_run_config
from rlfuse.api.models import load_model, resolve_model_folder
from rlfuse.api.trainers import DPOTrainer, GRPOTrainer, PPOTrainer, SFTTrainer
from rlfuse.run.config import DPOConfig, GRPOConfig, PPOConfig, RunConfig, SFTConfig

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "PPOConfig", "PPOTrainer", "RunConfig", "SFTConfig",
           "SFTTrainer", "load_model", "load_run_config", "resolve_model_folder"]
