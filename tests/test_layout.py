"""Property tests of zerofunc.layout: padding, sharding, views and owned pieces."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofunc.layout import ALIGN, FlatLayout, shard, unshard

SETTINGS = settings(max_examples=60, deadline=None)

shapes = st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple)
shape_lists = st.lists(shapes, min_size=1, max_size=6)
world_sizes = st.integers(1, 8)
seeds = st.integers(0, 2**31 - 1)


def build(shape_list, world_size) -> FlatLayout:
    return FlatLayout.build([(f"p{i}", s) for i, s in enumerate(shape_list)], world_size)


def make_params(layout: FlatLayout, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) for s in layout.slots}


def flat_from(layout: FlatLayout, params: dict[str, torch.Tensor]) -> torch.Tensor:
    body = [params[s.name].reshape(-1) for s in layout.slots]
    pad = torch.zeros(layout.padded_numel - layout.numel)
    return torch.cat(body + [pad])


@SETTINGS
@given(shape_list=shape_lists, world_size=world_sizes)
def test_build_pads_to_world_size_with_contiguous_slots(shape_list, world_size):
    layout = build(shape_list, world_size)
    expected_numel = sum(math.prod(s) for s in shape_list)

    assert layout.numel == expected_numel
    assert layout.padded_numel % world_size == 0
    assert layout.padded_numel >= layout.numel
    assert layout.shard_numel * world_size == layout.padded_numel
    # Each shard a multiple of ALIGN elements, and the smallest that holds the parameters:
    # at most ALIGN - 1 elements of padding per rank beyond ceil(numel / world_size).
    assert layout.shard_numel % ALIGN == 0
    assert layout.shard_numel - -(-layout.numel // world_size) < ALIGN
    assert layout.padded_numel - layout.numel < world_size * ALIGN

    # Slots in registration order, each starting where the previous one ends.
    assert [s.name for s in layout.slots] == [f"p{i}" for i in range(len(shape_list))]
    assert [s.shape for s in layout.slots] == [tuple(s) for s in shape_list]
    offset = 0
    for slot in layout.slots:
        assert slot.offset == offset
        assert slot.numel == math.prod(slot.shape)
        offset += slot.numel
    assert offset == layout.numel

    # Shard ranges tile [0, padded_numel) in rank order.
    stop_prev = 0
    for r in range(world_size):
        start, stop = layout.shard_range(r)
        assert start == stop_prev
        assert stop - start == layout.shard_numel
        stop_prev = stop
    assert stop_prev == layout.padded_numel


@SETTINGS
@given(shape_list=shape_lists, world_size=world_sizes,
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
def test_every_shard_of_a_fresh_buffer_is_16_byte_aligned(shape_list, world_size, dtype):
    """What the fused kernels' 128-bit loads need (tests/aot.py): a shard's first element, and every
    block of 16 elements after it, on a 16-byte boundary, whatever the rank and the dtype."""
    layout = build(shape_list, world_size)
    flat = torch.empty(layout.padded_numel, dtype=dtype)
    for r in range(world_size):
        s = shard(flat, r, world_size)
        assert s.numel() % ALIGN == 0
        assert s.numel() == 0 or s.data_ptr() % 16 == 0


def test_padding_is_at_most_align_minus_one_per_rank():
    """Exact figures: 198272 elements (a gpt2-tiny block) on 3 ranks were 66091 a rank, now 66096."""
    layout = FlatLayout.build([("w", (198272,))], 3)
    assert (layout.shard_numel, layout.padded_numel) == (66096, 198288)
    assert FlatLayout.build([("w", (198272,))], 2).padded_numel == 198272  # divisible already: no padding
    assert FlatLayout.build([("w", (1,))], 8).padded_numel == 8 * ALIGN
    assert FlatLayout.build([], 4).padded_numel == 0


@SETTINGS
@given(world_size=world_sizes, shard_len=st.integers(0, 20), seed=seeds)
def test_unshard_inverts_shard_and_shards_are_views(world_size, shard_len, seed):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(world_size * shard_len, generator=g)
    original = flat.clone()

    shards = [shard(flat, r, world_size) for r in range(world_size)]
    for r, s in enumerate(shards):
        assert s.numel() == shard_len
        assert torch.equal(s, original[r * shard_len:(r + 1) * shard_len])
        if shard_len:
            assert s.data_ptr() == flat.data_ptr() + r * shard_len * flat.element_size()

    rebuilt = unshard(shards)
    assert torch.equal(rebuilt, original)

    # Writing through a shard must change the flat buffer: no copy was made.
    if shard_len:
        r = world_size - 1
        shards[r].fill_(123.0)
        assert torch.all(flat[r * shard_len:] == 123.0)
        assert torch.equal(flat[:r * shard_len], original[:r * shard_len])


@SETTINGS
@given(shape_list=shape_lists, world_size=world_sizes, seed=seeds)
def test_views_are_shaped_views_of_flat(shape_list, world_size, seed):
    layout = build(shape_list, world_size)
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(layout.padded_numel, generator=g)

    views = layout.views(flat)
    assert list(views) == [s.name for s in layout.slots]
    for slot in layout.slots:
        v = views[slot.name]
        assert tuple(v.shape) == slot.shape
        assert torch.equal(v.reshape(-1), flat[slot.offset:slot.offset + slot.numel])
        assert v.data_ptr() == flat.data_ptr() + slot.offset * flat.element_size()

    # Writing through every view changes exactly the parameter part of flat.
    for i, slot in enumerate(layout.slots):
        views[slot.name].fill_(float(i + 1))
    for i, slot in enumerate(layout.slots):
        assert torch.all(flat[slot.offset:slot.offset + slot.numel] == float(i + 1))


@SETTINGS
@given(shape_list=shape_lists, world_size=world_sizes, seed=seeds)
def test_owned_pieces_cover_each_element_once_and_rebuild_flat(shape_list, world_size, seed):
    layout = build(shape_list, world_size)
    params = make_params(layout, seed)
    flat = flat_from(layout, params)
    assert flat.numel() == layout.padded_numel

    hits = {s.name: torch.zeros(s.numel, dtype=torch.int64) for s in layout.slots}
    shards = []
    for r in range(world_size):
        local = torch.zeros(layout.shard_numel)
        for slot, lo, hi, at in layout.owned_pieces(r):
            assert 0 <= lo < hi <= slot.numel
            assert 0 <= at and at + (hi - lo) <= layout.shard_numel
            local[at:at + hi - lo] = params[slot.name].reshape(-1)[lo:hi]
            hits[slot.name][lo:hi] += 1
        shards.append(local)

    for name, h in hits.items():
        assert torch.all(h == 1), f"{name} covered {h.tolist()}"
    assert torch.equal(torch.cat(shards), flat)


def test_world_size_zero_raises():
    with pytest.raises(ValueError):
        FlatLayout.build([("w", (3,))], 0)
    with pytest.raises(ValueError):
        FlatLayout.build([("w", (3,))], -1)


@settings(max_examples=30, deadline=None)
@given(world_size=st.integers(2, 8), n=st.integers(1, 60))
def test_shard_of_indivisible_buffer_raises(world_size, n):
    if n % world_size == 0:
        n += 1
    with pytest.raises(ValueError):
        shard(torch.zeros(n), 0, world_size)


def test_unshard_of_unequal_shards_raises():
    with pytest.raises(ValueError):
        unshard([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError):
        unshard([torch.zeros(2), torch.zeros(2), torch.zeros(1)])


@settings(max_examples=30, deadline=None)
@given(shape_list=shape_lists, world_size=world_sizes, delta=st.sampled_from([-1, 1, 2]))
def test_views_of_wrong_sized_buffer_raises(shape_list, world_size, delta):
    layout = build(shape_list, world_size)
    with pytest.raises(ValueError):
        layout.views(torch.zeros(layout.padded_numel + delta))
