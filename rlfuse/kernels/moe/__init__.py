"""Mixture-of-experts ops: top-k routing and the token-to-expert sort, the experts' grouped GEMMs, the weighted combine."""

from rlfuse.kernels.moe.combine import combine, gather_rows
from rlfuse.kernels.moe.experts import ExpertLoRA, experts_mlp
from rlfuse.kernels.moe.grouped_gemm import grouped_linear
from rlfuse.kernels.moe.routing import Routing, route, routing_mismatch, sort_by_expert, topk_softmax

__all__ = ["ExpertLoRA", "Routing", "combine", "experts_mlp", "gather_rows", "grouped_linear", "route", "routing_mismatch",
           "sort_by_expert", "topk_softmax"]
