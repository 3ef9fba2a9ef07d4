"""rlfuse: RL post-training of LLMs with one copy of the weights.

A built-in inference engine generates rollouts from the same parameter tensors the
trainer updates in place. The Python API (docs/python-api.md):

    from rlfuse import GRPOConfig, GRPOTrainer, SFTTrainer, load_model
    sft = SFTTrainer("MODEL_DIR", train_dataset=rows, run_dir="runs/sft"); sft.train()
    grpo = GRPOTrainer(sft, reward_funcs=[fn], train_dataset=prompts, args=GRPOConfig(steps=50)); grpo.train()

The command line (`rlfuse --help`) runs the same trainers; see README.md.
"""

__version__ = "0.1.0"
__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "PPOConfig", "PPOTrainer", "RunConfig", "SFTConfig",
           "SFTTrainer", "load_model", "load_run_config"]


def __getattr__(name: str):
    """The Python API's names, imported from rlfuse.api on first use: `import rlfuse` (and
    `rlfuse --version`, `rlfuse --help`) must not pay for torch (issue 37, seconds per start)."""
    if name in __all__:
        import rlfuse.api as api  # lazy on purpose: see the docstring

        return getattr(api, name)
    raise AttributeError(f"module 'rlfuse' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
