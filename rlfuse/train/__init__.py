"""The algorithms: advantage estimators, off-policy corrections, PPO's math, and the SFT,
GRPO (and variants), PPO and DPO trainers on the shared loop and session."""

from rlfuse.train.dpo import run_dpo
from rlfuse.train.grpo import run_grpo
from rlfuse.train.loop import make_optimizer
from rlfuse.train.ppo import run_ppo
from rlfuse.train.session import Session, open_session
from rlfuse.train.sft import SFTStep, run_sft

__all__ = ["SFTStep", "Session", "make_optimizer", "open_session", "run_dpo", "run_grpo", "run_ppo", "run_sft"]
