"""The generation throughput benchmark (`rlfuse bench generate`): published model shapes with random weights, the cases, the memory-bandwidth bound, the timed run against transformers `generate`; the benchmarks/ scripts import its helpers from here."""

from rlfuse.engine.benchmark.bound import bound_bytes, copy_bandwidth, routed_expert_bytes, state_bytes_per_step
from rlfuse.engine.benchmark.cases import Case, make_cases
from rlfuse.engine.benchmark.generate import BenchConfig, run, table
from rlfuse.engine.benchmark.shapes import (
    MOE_SHAPES,
    QWEN3_06B,
    QWEN3_5_SHAPES,
    QWEN3_SHAPES,
    SHAPES,
    TINY,
    build_model,
    random_model,
)

__all__ = ["MOE_SHAPES", "QWEN3_06B", "QWEN3_5_SHAPES", "QWEN3_SHAPES", "SHAPES", "TINY", "BenchConfig", "Case",
           "bound_bytes", "build_model", "copy_bandwidth", "make_cases", "random_model", "routed_expert_bytes", "run",
           "state_bytes_per_step", "table"]
