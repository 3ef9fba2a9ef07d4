"""The host side of shared-prefix decode: which running sequences read their common prompt
blocks once, as a `rlfuse.kernels.attention.SharedPrefixDecode` the paged-attention kernel takes
(the kernel's side, and why the exact output is bitwise the unshared one: the module docstring of
`rlfuse.kernels.attention.paged`).

`plan_shared_prefix` groups sequences by the cache blocks their prompts start with (the
block ids, not the tokens: the prefix cache already made equal prompts share blocks);
`shared_prefix_pays` says whether a plan is worth its extra programs on this device. The
static decode path (`rlfuse.engine.step.static_decode`) calls both once per change of the running set.
Test: python -m pytest -q tests/test_kernel_shared_prefix.py
"""

from __future__ import annotations

import numpy as np
import torch

from rlfuse.kernels.attention import KV_BLOCK
from rlfuse.kernels.backend import num_sms


def shared_prefix_pays(chunks: int, shared_tokens: int, n_kv_heads: int, kv_token_bytes: int,
                       device: torch.device) -> bool:
    """Whether a plan of `chunks` chunks sharing `shared_tokens` keys in all (one layer's K/V
    of a key: `kv_token_bytes`) is worth its prefix programs, which run before the suffix
    programs: when they fill the GPU (chunks x kv heads >= SMs), or when the prefixes' K/V
    outgrow the L2 cache, which otherwise already serves most repeated reads of a short
    prefix (H100, docs/perf-log.md: 8 prompts of 128 keys x 8 completions decoded 7%
    slower shared; 32 prompts of 250 x 8, 9% faster)."""
    if device.type != "cuda":
        return chunks > 0
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return chunks * n_kv_heads >= num_sms(device) or shared_tokens * kv_token_bytes >= l2


def _common_blocks(a, b) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def plan_shared_prefix(keys: list, page: int, max_members: int, max_chunks: int):
    """Host side of `SharedPrefixDecode`: keys[b] = the block ids sequence b may share (its
    prompt's full blocks) or None. Sorted by key, neighbours share their common leading
    blocks; a run is cut where that common part is at most half a neighbouring pair's (so
    the completions of one prompt form a group even when every prompt starts with the same
    system prompt, and prompts that share only a system prompt form one). A group shares
    the blocks all its members have in common, in whole KV_BLOCKs (>= one), in chunks of
    2..max_members. Returns numpy int64 (share_len (B,), perm (B,), first (max_chunks,),
    count (max_chunks,)) and the chunk count (chunks past max_chunks stay unshared)."""
    B = len(keys)
    share_len = np.zeros(B, np.int64)
    perm = np.zeros(B, np.int64)
    first = np.zeros(max_chunks, np.int64)
    count = np.zeros(max_chunks, np.int64)
    order = sorted((b for b in range(B) if keys[b] is not None and len(keys[b]) * page >= KV_BLOCK),
                   key=lambda b: tuple(keys[b]))
    common = [_common_blocks(keys[a], keys[b]) * page // KV_BLOCK for a, b in zip(order, order[1:])]  # tiles
    # cut between neighbours that share nothing, or at most half what a neighbouring pair shares
    cut = [c == 0 or 2 * c <= max(common[i - 1] if i else 0, common[i + 1] if i + 1 < len(common) else 0)
           for i, c in enumerate(common)]
    groups, run, tiles = [], order[:1], None  # (members, tiles all of them share)
    for i, b in enumerate(order[1:]):
        if cut[i]:
            if len(run) > 1:
                groups.append((run, tiles))
            run, tiles = [b], None
        else:
            run.append(b)
            tiles = common[i] if tiles is None else min(tiles, common[i])
    if len(run) > 1:
        groups.append((run, tiles))
    c = o = 0
    for members, tiles in groups:
        for j in range(0, len(members) - 1, max_members):
            part = members[j:j + max_members]
            if len(part) < 2 or c == max_chunks:
                continue
            first[c], count[c] = o, len(part)
            perm[o:o + len(part)] = part
            share_len[part] = tiles * KV_BLOCK
            c, o = c + 1, o + len(part)
    return share_len, perm, first, count, c
