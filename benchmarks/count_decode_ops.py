"""Kernels one linear-attention layer's static decode step launches (`GatedDeltaNet.forward_decode`),
counted on the CPU: the only speed evidence a machine without a GPU gives (issue 34's decode
target: the fast step's copy / index and small elementwise kernels).

Every aten op that would launch a GPU kernel (views, `empty` allocations and other metadata
ops excluded) is counted by a `TorchDispatchMode`, and every Triton launch (run under
`TRITON_INTERPRET=1`) as one kernel; the interpreter's own argument copies inside a launch
are not counted. The layer is the tiny Qwen3.5 hybrid's (the counts do not depend on the
widths), B rows on out-of-order slots of the engine's state pool, Triton backend.

    python benchmarks/count_decode_ops.py            # fast and exact numerics, bf16 and fp32, B = 4
Prints one table row per (numerics, dtype, input projections separate or fused by
`rlfuse.model.fuse`): the kernels a step, then per op; then the same for one whole engine
decode step of the tiny hybrid (`LLM.step()`, bf16, the engine fusing or not).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: Triton kernels on the CPU

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from rlfuse.kernels import use_backend, use_numerics  # noqa: E402
from rlfuse.model import CausalLM, LinearDecode, ModelConfig  # noqa: E402
from rlfuse.model.arch.qwen3_5 import tiny_hybrid_fields  # noqa: E402
from rlfuse.model.fuse import fuse_projections  # noqa: E402

# aten ops that launch no kernel: views, allocations, metadata
NO_KERNEL = {"view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select", "as_strided",
             "t", "transpose", "permute", "unsqueeze", "squeeze", "expand", "detach", "alias", "lift_fresh",
             "empty", "empty_like", "new_empty", "empty_strided", "set_", "unbind", "_reshape_alias",
             "promote_types"}


class KernelCount(TorchDispatchMode):
    """Counts kernel-launching aten ops and Triton launches (by name) while active."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self._in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._in_triton and name not in NO_KERNEL:
            self.ops[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def triton_launches(self):
        """Counts each interpreted Triton launch as one kernel (its argument copies: none)."""
        run = interpreter.GridExecutor.__call__
        counter = self

        def counted(executor, *args, **kwargs):
            counter.ops[f"triton.{executor.fn.__name__}"] += 1
            counter._in_triton += 1
            try:
                return run(executor, *args, **kwargs)
            finally:
                counter._in_triton -= 1

        with mock.patch.object(interpreter.GridExecutor, "__call__", counted):
            yield self

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def decode_step_kernels(numerics: str, dtype=torch.float32, batch: int = 4, seed: int = 0,
                        fused: bool = False) -> collections.Counter[str]:
    """The kernels of one `forward_decode` of one linear-attention layer in `numerics`, the
    model (all its parameters) and the state pool's "model" tensors in `dtype`; `fused`:
    its input projections as one GEMM (`fuse_projections`)."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(**tiny_hybrid_fields(num_hidden_layers=1, layer_types=("linear_attention",))))
    model = model.to(dtype)
    if fused:
        fuse_projections(model)
    layer = model.model.layers[0].linear_attn
    exact = numerics == "exact"
    pool = batch + 3  # more slots than rows; rows on out-of-order slots
    kinds = {"model": dtype, "fp32": torch.float32}
    state = {0: {n: torch.zeros(pool, *shape, dtype=kinds[kind]) for n, (shape, kind) in
                 layer.state_shapes(exact).items()}}
    slots = torch.randperm(pool)[:batch]
    index = torch.full((batch,), 5)
    x = torch.randn(batch, model.config.hidden_size).to(dtype)
    with torch.no_grad(), use_backend("triton"), use_numerics(numerics):
        layer.forward_decode(x, index, LinearDecode(state, slots, index))  # compile / warm outside the count
        count = KernelCount()
        with count, count.triton_launches():
            layer.forward_decode(x, index, LinearDecode(state, slots, index))
    return count.ops


def engine_step_kernels(numerics: str, dtype=torch.bfloat16, seed: int = 0,
                        fused: bool = False) -> collections.Counter[str]:
    """The kernels of one whole engine decode step (`LLM.step()`: the static decode path's
    forward of the tiny hybrid's 4 layers, 3 of them linear attention, then log-probs and
    sampling) of 2 sequences in steady decode; `fused`: the engine fuses the projections."""
    from rlfuse.engine import LLM, EngineConfig, SamplingParams  # the engine only for this count

    model = CausalLM(ModelConfig(**tiny_hybrid_fields(vocab_size=128)))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    model = model.to(dtype).eval()
    with torch.no_grad(), use_backend("triton"):
        llm = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=8, numerics=numerics,
                                            num_kv_blocks=64, block_size=16, fuse_projections=fused))
        for prompt in ([5, 6, 7, 8, 9], [3, 4, 5]):
            llm.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=1))
        for _ in range(4):  # prefill, then decode steps (compiles outside the count)
            llm.step()
        count = KernelCount()
        with count, count.triton_launches():
            llm.step()
    return count.ops


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv=None) -> None:
    del argv
    print("one linear-attention layer's decode step (forward_decode)")
    print(_row(["numerics", "dtype", "in_proj", "kernels", "ops"]) + "\n" + _row(["---"] * 5))
    for numerics in ("fast", "exact"):
        for dtype in (torch.bfloat16, torch.float32):
            for fused in (False, True):
                ops = decode_step_kernels(numerics, dtype, fused=fused)
                detail = ", ".join(f"{k} {v}" for k, v in sorted(ops.items()))
                print(_row([numerics, str(dtype).removeprefix("torch."), "fused" if fused else "separate",
                            sum(ops.values()), detail]))
    print("\none engine decode step of the tiny hybrid (4 layers, 3 linear attention), bf16")
    print(_row(["numerics", "projections", "kernels", "ops"]) + "\n" + _row(["---"] * 4))
    for numerics in ("fast", "exact"):
        for fused in (False, True):
            ops = engine_step_kernels(numerics, fused=fused)
            detail = ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]))
            print(_row([numerics, "fused" if fused else "separate", sum(ops.values()), detail]))


if __name__ == "__main__":
    main(sys.argv[1:])
