"""Engine bookkeeping of image prompts (rlfuse/engine/media.py), without a vision tower:
prefix-cache keys carry media hashes, mRoPE positions equal transformers' get_rope_index,
the feature cache encodes each distinct image once, vision ids are never sampled."""

import types

import pytest
import torch
from engine_helpers import one_thread, tiny_model  # noqa: F401 -- one_thread: an autouse fixture

from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.engine.cache.blocks import BlockManager
from rlfuse.engine.media import (
    FeatureCache,
    MediaItem,
    check_media,
    never_sampled_ids,
    prompt_positions,
)
from rlfuse.engine.sequence import Sequence, sample_key_base
from rlfuse.model.vision import ImageFeatures

PAD = 9


def _item(tag: int, offset: int, grid=(1, 4, 4), merge=2) -> MediaItem:
    n = grid[0] * grid[1] * grid[2] // merge ** 2
    return MediaItem(torch.full((grid[1] * grid[2], 8), float(tag)), grid, bytes([tag]) * 32, offset, n)


def _prompt(media, length):
    ids = [1 + (i % 5) for i in range(length)]
    for m in media:
        ids[m.offset:m.end] = [PAD] * m.num_tokens
    return ids


def _seq(i, ids, media=()):
    return Sequence(i, f"r{i}", 0, ids, SamplingParams(), 0, frozenset(), tuple(media))


def test_block_keys_include_the_images_overlapping_them():
    # block size 4; the image's 4 pad tokens are 5..8: blocks 1 and 2 overlap it
    B = 4
    a, b = (_item(1, 5),), (_item(2, 5),)
    ids = _prompt(a, 16)
    assert ids == _prompt(b, 16)  # equal ids, different images
    bm = BlockManager(32, B)
    s1 = _seq(1, ids, a)
    bm.allocate(s1, bm.match_prefix(s1)[0])
    s1.num_computed = 16
    bm.mark_computed(s1)
    h_a = list(s1.block_hashes)
    s2 = _seq(2, ids, b)
    hits, pending = bm.match_prefix(s2)
    assert not pending and hits == s1.block_table[:1]  # only the text block before the image is shared
    assert s2.block_hashes[0] == h_a[0] and all(x != y for x, y in zip(s2.block_hashes[1:], h_a[1:]))
    s3 = _seq(3, ids, a)  # the same image: the whole prefix is shared (the last block recomputed)
    assert bm.match_prefix(s3) == (s1.block_table[:3], False)
    # text-only keys are unchanged by the media plumbing
    t = _seq(4, ids)
    bm2 = BlockManager(8, B)
    bm2.match_prefix(t)
    assert t.block_hashes[1] != h_a[1]
    assert sample_key_base(0, ids, a) != sample_key_base(0, ids, b) != sample_key_base(0, ids)


def _hf_rope_index(ids, grids, merge, image_token_id):
    """transformers' Qwen3VLModel.get_rope_index on one sequence (bound to a stand-in self)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel
    fake = types.SimpleNamespace(config=types.SimpleNamespace(
        vision_config=types.SimpleNamespace(spatial_merge_size=merge), image_token_id=image_token_id))
    fake.get_vision_position_ids = types.MethodType(Qwen3VLModel.get_vision_position_ids, fake)
    x = torch.tensor([ids])
    tt = (x == image_token_id).int()
    pos, delta = Qwen3VLModel.get_rope_index(fake, x, tt, image_grid_thw=torch.tensor(grids) if grids else None)
    return pos[:, 0], int(delta[0, 0])


@pytest.mark.parametrize("layout", [
    [],                                                       # text only
    [(3, (1, 4, 6))],                                         # one image, 2 x 3 merged
    [(2, (1, 6, 2)), (12, (1, 2, 8))],                        # two images of different sizes
    [(0, (1, 2, 2)), (2, (1, 4, 4))],                         # an image first, images adjacent but for 1 token
])
def test_prompt_positions_equal_transformers(layout):
    media = tuple(_item(k + 1, off, grid) for k, (off, grid) in enumerate(layout))
    ids = _prompt(media, 24)
    vision = types.SimpleNamespace(spatial_merge_size=2, image_token_id=PAD)
    pos, delta = prompt_positions(ids, media, vision)
    want, want_delta = _hf_rope_index(ids, [list(m.grid_thw) for m in media], 2, PAD)
    assert torch.equal(pos, want) and delta == want_delta
    # a completion continues at index + delta on all three rows: the positions of the longer sequence
    longer, _ = prompt_positions(ids + [1, 2, 3], media, vision)
    assert torch.equal(longer[:, len(ids):], (torch.arange(len(ids), len(ids) + 3) + delta).expand(3, -1))


def test_check_media_rejects_spans_that_do_not_match_the_ids():
    m = (_item(1, 2),)
    ids = _prompt(m, 10)
    check_media(m, ids, PAD, "p")
    with pytest.raises(ValueError, match="p: the prompt holds 5 image-pad tokens but its 1 images account for 4"):
        check_media(m, ids[:7] + [PAD] + ids[8:], PAD, "p")
    with pytest.raises(ValueError, match="p: image 0 spans tokens"):
        check_media((_item(1, 3),), ids, PAD, "p")


def test_feature_cache_encodes_each_image_once_per_group_and_slices_chunks():
    runs = []

    def encode(items):
        runs.extend(m.media_hash for m in items)
        e = torch.cat([m.pixel_values[::4, :3] + torch.arange(m.num_tokens).view(-1, 1) for m in items])
        return ImageFeatures(e, torch.stack([2 * e]))  # merged features and one DeepStack level

    cache = FeatureCache(encode)
    a, b = _item(1, 2), _item(2, 10)
    group = [(a, b)] * 8  # a GRPO group of 8 samples, two images each
    for media in group:
        cache.acquire(media)
    for media in group:
        for m in media:
            cache.features(m)
    assert cache.take_encodes() == 2 and runs == [a.media_hash, b.media_hash] and cache.live == 2
    # a prefill chunk of tokens [4, 12): the last 2 rows of image a (tokens 4, 5), the first 2 of b (10, 11)
    part = ImageFeatures.cat(cache.chunk_features((a, b), 4, 8))
    fa, fb = cache.features(a).embeds, cache.features(b).embeds
    assert torch.equal(part.embeds, torch.cat([fa[2:4], fb[0:2]])) and torch.equal(part.deepstack[0], 2 * part.embeds)
    assert cache.chunk_features((a, b), 6, 4) == []
    for media in group:
        cache.release(media)
    assert cache.live == 0 and cache.take_encodes() == 0
    cache.acquire((a,))
    cache.features(a)
    assert cache.take_encodes() == 1  # freed with the last holder: a later request encodes again


def test_vision_ids_are_never_sampled():
    vision = types.SimpleNamespace(image_token_id=5, vision_start_token_id=3, vision_end_token_id=4,
                                   video_token_id=None)
    assert never_sampled_ids(types.SimpleNamespace(vision=vision)) == (3, 4, 5)
    assert never_sampled_ids(types.SimpleNamespace(vision=None)) == ()
    model = tiny_model(seed=3, std=0.5)
    llm = LLM(model, config=EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=8, enforce_eager=True))
    params = SamplingParams(n=8, max_tokens=24, temperature=1.5, seed=0)
    free = [t for c in llm.generate([[1, 2, 3, 4]], params) for t in c.output_token_ids]
    banned = sorted(set(free))[:12]  # the ids this model samples most freely
    llm.runner.sampler.never_sample = torch.tensor(banned)
    got = llm.generate([[1, 2, 3, 4]], params)
    assert not {t for c in got for t in c.output_token_ids} & set(banned)
    # the reported log-prob is the unfiltered policy's (the trainer's): finite, <= 0
    assert all(torch.isfinite(c.logprobs).all() and (c.logprobs <= 0).all() for c in got)


def test_equal_ids_other_image_is_not_served_from_the_prefix_cache():
    """The engine with a tiny Qwen3-VL: a prompt generated with image X, then the same ids with
    image Y on the same engine (prefix cache on) give Y's own completion and log-probs (those of
    a fresh engine), not X's cached K/V; X again hits the cache and repeats itself."""
    from PIL import Image

    from rlfuse.data import VisionData, expand_images
    from rlfuse.model import CausalLM, ModelConfig
    from rlfuse.model.arch.qwen3_vl import tiny_vl_fields
    from rlfuse.model.vision.processor import ImageProcessor

    model = CausalLM(ModelConfig(**tiny_vl_fields()))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    v = model.config.vision
    vision = VisionData(ImageProcessor.for_model(v, min_pixels=64, max_pixels=1024), v.vision_start_token_id,
                        v.image_token_id, v.vision_end_token_id)
    g = torch.Generator().manual_seed(1)
    imgs = [Image.frombytes("RGB", (16, 16), bytes(torch.randint(0, 256, (768,), generator=g).tolist()))
            for _ in range(2)]
    text = [1, 2, 3, v.vision_start_token_id, v.image_token_id, v.vision_end_token_id] + list(range(10, 30))
    prompts = [expand_images(text, [("image", im)], vision, "p", 512)[:2] for im in imgs]
    assert prompts[0][0] == prompts[1][0]  # equal ids
    cfg = EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(llm, k):
        (c,) = llm.generate([prompts[k][0]], params, media=[prompts[k][1]])
        return c

    llm = LLM(model, config=cfg)
    x, y, x2 = run(llm, 0), run(llm, 1), run(llm, 0)
    fresh_y = run(LLM(model, config=cfg), 1)
    assert y.output_token_ids == fresh_y.output_token_ids and torch.equal(y.logprobs, fresh_y.logprobs)
    assert y.num_cached_prompt_tokens == 0 and x2.num_cached_prompt_tokens == 24  # the image is in block 0
    assert x2.output_token_ids == x.output_token_ids and not torch.equal(x.logprobs, y.logprobs)
    assert llm.stats.vision_encodes == 2  # X (released when done, then a cache hit needs no encode), Y
