"""Token sampling: temperature, top-k / top-p / min-p and a counter-based random draw."""

from rlfuse.kernels.sampling.draw import filter_logits_ref, row_keys, sample, sample_ref, uniform_from_keys

__all__ = ["filter_logits_ref", "row_keys", "sample", "sample_ref", "uniform_from_keys"]
