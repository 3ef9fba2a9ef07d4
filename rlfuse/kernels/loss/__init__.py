"""Losses on hidden states: token log-probs (fused LM head) and the clipped policy loss."""

from rlfuse.kernels.loss.logprob import token_logprobs, token_logprobs_exact_ref, token_logprobs_ref
from rlfuse.kernels.loss.policy import (
                                        KL_TYPES,
                                        LOSS_TYPES,
                                        TOKEN_MEAN_TYPES,
                                        accumulation_weight,
                                        grpo_loss_from_hidden,
                                        kl_term,
                                        policy_loss,
                                        policy_loss_ref,
                                        ratio_bounds,
)

__all__ = ["KL_TYPES", "LOSS_TYPES", "TOKEN_MEAN_TYPES", "accumulation_weight", "grpo_loss_from_hidden", "kl_term",
           "policy_loss", "policy_loss_ref", "ratio_bounds", "token_logprobs", "token_logprobs_exact_ref",
           "token_logprobs_ref"]
