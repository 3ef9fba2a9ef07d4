"""The step's sampling glue: fp32 logits from the last hidden states, the masks the
request asks for, `rlfuse.kernels.sampling.draw.sample`, and the reported log-probs.

  1. logits = h_last @ W^T in fp32 (W: the model's LM head, read at every call, so a
     trainer's in-place update is seen): straight from a half-precision matmul with
     `torch.mm(..., out_dtype=float32)` where CUDA offers it, else the matmul cast to fp32.
  2. masks: a sequence with fewer than min_tokens outputs has its stop ids (EOS included)
     at -inf; a vision model's image-pad / vision start / end ids are always -inf.
  3. sample with per-row top-k / top-p / min-p / temperature, seeds and offset = the
     sampled token's position (no host sync).
  4. the log-prob of each sampled id from `rlfuse.kernels.loss.logprob.token_logprobs`
     (the trainer's function) on the unfiltered logits, per distinct temperature.
The runner (`rlfuse.engine.step.runner`) calls `draw` once per step.
Test: python -m pytest -q tests/test_engine.py tests/test_vision_engine.py
"""

from __future__ import annotations

import logging

import torch

from rlfuse.engine.media import never_sampled_ids
from rlfuse.engine.step.upload import upload
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.kernels.sampling.draw import sample
from rlfuse.model import CausalLM

log = logging.getLogger(__name__)


class Sampler:
    """Logits, sampling and log-probs of a step's sampled rows (the module docstring).
    `never_sample`: the ids always masked (a vision model's), or None."""

    def __init__(self, model: CausalLM):
        self.model = model
        W = model.lm_head_weight
        self.device, self.dtype = W.device, W.dtype
        self.out_dtype_mm = self._probe_out_dtype_mm()
        # vision models: the image-pad / vision start / end ids are never sampled (rlfuse.engine.media)
        banned = never_sampled_ids(model.config)
        self.never_sample = torch.tensor(banned, dtype=torch.int64, device=self.device) if banned else None

    def draw(self, h: torch.Tensor, samp: list, k_t: torch.Tensor, seed_t: torch.Tensor, off_t: torch.Tensor,
             ahead: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample the S rows of `h` (S, D); `samp`: each row's (SamplingParams, Sequence);
        `k_t`, `seed_t`, `off_t`: the step's top-k, seeds and offsets on the device; `ahead`:
        1 for a look-ahead step (one output more than the host has seen). -> (ids, log-probs)."""
        S = len(samp)
        pad = [0.0] * (-S % 4)  # rows of fl start 16-byte aligned (see static_decode._field_stride)
        fl = upload([[p.temperature for p, _ in samp] + pad, [p.top_p for p, _ in samp] + pad,
                     [p.min_p for p, _ in samp] + pad], torch.float32, self.device)[:, :S]
        logits = self.logits(h)
        masks = [(i, t) for i, (p, s) in enumerate(samp) if s.num_output_tokens + ahead < p.min_tokens
                 for t in s.stop_ids]
        if masks:
            idx = upload(masks, torch.int64, self.device)
            logits[idx[:, 0], idx[:, 1]] = float("-inf")
        if self.never_sample is not None:
            logits[:, self.never_sample] = float("-inf")
        ids, _ = sample(logits, fl[0], k_t, fl[1], fl[2], seed_t, off_t)
        lps = self.logprobs(h, ids, [s.temperature_lp for _, s in samp])
        return ids, lps

    def warmup(self, S: int) -> None:
        """The largest sampling step: logits, filtered sampling and log-probs for S rows."""
        h = torch.randn(S, self.model.config.hidden_size, device=self.device).to(self.dtype)
        logits = self.logits(h)
        f = lambda v: torch.full((S,), v, device=self.device)  # noqa: E731
        z = torch.zeros(S, dtype=torch.long, device=self.device)
        ids, _ = sample(logits, f(1.0), z + 50, f(0.9), f(0.05), z, z)
        token_logprobs(h, self.model.lm_head_weight, ids, 1.0)

    def _probe_out_dtype_mm(self) -> bool:
        """fp32 logits straight from a half-precision matmul (torch.mm(..., out_dtype=float32),
        CUDA only): exact fp32 accumulation without a fp32 copy of the LM head."""
        if self.dtype == torch.float32:
            return False
        if self.device.type == "cuda":
            a = torch.zeros(2, 8, dtype=self.dtype, device=self.device)
            try:
                ok = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
            except (RuntimeError, TypeError) as e:  # older torch: no out_dtype overload
                ok, why = False, str(e).splitlines()[0]
            if ok:
                log.info("logits: fp32 output of the %s LM-head matmul (torch.mm out_dtype)", self.dtype)
                return True
            log.warning("logits: torch.mm(out_dtype=float32) unavailable (%s); sampling from %s logits cast "
                        "to fp32", why, self.dtype)
        else:
            log.info("logits on %s in %s, cast to fp32 for sampling", self.device, self.dtype)
        return False

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        W = self.model.lm_head_weight
        if self.out_dtype_mm:
            return torch.mm(h, W.t(), out_dtype=torch.float32)
        return torch.mm(h, W.t()).float()

    def logprobs(self, h: torch.Tensor, ids: torch.Tensor, temps: list[float]) -> torch.Tensor:
        W = self.model.lm_head_weight
        distinct = sorted(set(temps))
        if len(distinct) == 1:
            return token_logprobs(h, W, ids, distinct[0])
        out = torch.empty(len(temps), dtype=torch.float32, device=h.device)
        for t in distinct:  # one call per temperature: bitwise what the trainer computes per row
            idx = upload([i for i, x in enumerate(temps) if x == t], torch.int64, self.device)
            out[idx] = token_logprobs(h[idx], W, ids[idx], t)
        return out
