"""rlfuse: RL post-training of LLMs with one copy of the weights.

A built-in inference engine generates rollouts from the same parameter tensors the
trainer updates in place. See README.md for the two set-up commands and the demo.
"""

__version__ = "0.1.0"
