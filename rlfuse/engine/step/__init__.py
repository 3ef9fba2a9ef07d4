"""One engine step on the live model: the runner (`ModelRunner`: block-table rows, the step's launch and read-back) and its pieces -- the eager step, the static (CUDA-graph) decode step and its shared-prefix plan, the sampler, the MoE routing record, the host-to-device upload."""

from rlfuse.engine.step.pending import Pending, collect
from rlfuse.engine.step.runner import ModelRunner, param_version

__all__ = ["ModelRunner", "Pending", "collect", "param_version"]
