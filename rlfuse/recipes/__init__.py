"""Experiments as recipes on the public API: the demos `rlfuse demo` runs (SFT warm-up then GRPO, PPO, the agent)."""
