"""rlfuse: RL post-training of LLMs with one copy of the weights.

A built-in inference engine generates rollouts from the same parameter tensors the
trainer updates in place. The Python API (docs/python-api.md):

    from rlfuse import GRPOConfig, GRPOTrainer, SFTTrainer, load_model
    sft = SFTTrainer("MODEL_DIR", train_dataset=rows, run_dir="runs/sft"); sft.train()
    grpo = GRPOTrainer(sft, reward_funcs=[fn], train_dataset=prompts, args=GRPOConfig(steps=50)); grpo.train()

The command line (`rlfuse --help`) runs the same trainers; see README.md.
"""

from rlfuse.api import (
                        DPOConfig,
                        DPOTrainer,
                        GRPOConfig,
                        GRPOTrainer,
                        PPOConfig,
                        PPOTrainer,
                        RunConfig,
                        SFTConfig,
                        SFTTrainer,
                        load_model,
                        load_run_config,
)

__version__ = "0.1.0"
__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "PPOConfig", "PPOTrainer", "RunConfig", "SFTConfig",
           "SFTTrainer", "load_model", "load_run_config"]
