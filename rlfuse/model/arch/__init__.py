"""The architecture registry: HF `model_type` -> `ArchSpec` (layers, config switches, checkpoint names); one file per family, one line here."""

from rlfuse.model.arch.llama import LLAMA
from rlfuse.model.arch.qwen2 import QWEN2
from rlfuse.model.arch.qwen3 import QWEN3
from rlfuse.model.arch.qwen3_5 import QWEN3_5
from rlfuse.model.arch.qwen3_5_moe import QWEN3_5_MOE
from rlfuse.model.arch.qwen3_5_vl import QWEN3_5_VL
from rlfuse.model.arch.qwen3_moe import QWEN3_MOE
from rlfuse.model.arch.qwen3_next import QWEN3_NEXT
from rlfuse.model.arch.qwen3_vl import QWEN3_VL
from rlfuse.model.arch.spec import SWITCHES, ArchSpec

ARCHS: dict[str, ArchSpec] = {
    s.model_type: s for s in (LLAMA, QWEN2, QWEN3, QWEN3_5, QWEN3_5_MOE, QWEN3_5_VL, QWEN3_MOE, QWEN3_NEXT, QWEN3_VL)}
"""Every supported architecture, by HF model_type (docs/models.md is generated from it)."""

__all__ = ["ARCHS", "SWITCHES", "ArchSpec"]
