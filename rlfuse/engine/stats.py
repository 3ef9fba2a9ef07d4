"""`EngineStats`: the engine's step and token counters (`LLM.stats`), read by the benchmarks,
`rlfuse check` and the rollout metrics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class EngineStats:
    """Counters since construction (or `reset()`)."""
    steps: int = 0
    decode_steps: int = 0
    graph_steps: int = 0
    prompt_tokens_computed: int = 0
    """Prompt tokens whose K/V was computed (prefill chunks, recompute after preemption)."""
    prompt_tokens_cached: int = 0
    """Prompt tokens taken from the prefix cache at admission instead of computed."""
    tokens_computed: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    shared_prefix_steps: int = 0
    """Decode steps that read a shared prompt prefix once per group (share_prefix_decode)."""
    look_ahead_steps: int = 0
    """Decode steps launched before the previous step's results were read (look-ahead)."""
    discarded_tokens: int = 0
    """Look-ahead samples of sequences that had stopped on a token in the step before."""
    kv_calibrations: int = 0
    """fp8 KV cache: scale calibrations (one per weight update that a request followed)."""
    vision_encodes: int = 0
    """Vision-tower runs (one per distinct image held by live sequences: a group's n samples share one)."""

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


