"""What a step on meta tensors knows of values (sim/known_values.py): a value computed from the batch alone is
read as the host computes it, one computed from anything else is refused, and the planner's instruments see
each op once. Then the planner: a model that reads a batch's value is planned (tests/test_llama_plan.py trains
BART and T5Gemma beside their plans), one that reads an activation's is refused in one line."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from sim.known_values import LIMIT, KnownValues, UnknownValue
from zerofunc.plan import Plan, simulate

SETTINGS = settings(max_examples=40, deadline=None)


def batch_program(ids: torch.Tensor, pad: int) -> list:
    """What Hugging Face's models compute from token ids before the first weight, and read on the host: a
    padding mask and whether it is all ones (masking_utils), decoder inputs shifted right by a slice
    assignment (T5Gemma's `_shift_right`), positions from a factory, and reads of every kind."""
    mask = ids != pad
    shifted = ids.new_zeros(ids.shape)
    shifted[..., 1:] = ids[..., :-1].clone()
    shifted[..., 0] = 7
    shifted.masked_fill_(shifted == pad, -1)
    positions = torch.arange(ids.shape[-1], device=ids.device)
    return [bool(mask.all()), int(mask.sum()), shifted.tolist(), mask.nonzero().shape[0],
            torch.equal(shifted, ids), float((positions * mask).amax()), (mask.sum(-1) - 1).cpu().tolist()]


@SETTINGS
@given(rows=st.integers(1, 3), cols=st.integers(1, 9), pad=st.integers(0, 3), data=st.data())
def test_a_value_computed_from_the_batch_alone_is_read_as_the_host_computes_it(rows, cols, pad, data):
    host = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 5), min_size=cols, max_size=cols),
                                           min_size=rows, max_size=rows)))
    ids = torch.empty(host.shape, dtype=host.dtype, device="meta")
    with KnownValues() as known:
        known.know(ids, host)
        on_meta = batch_program(ids, pad)
    assert on_meta == batch_program(host, pad)


def _activation(ids, weights):
    return bool(((ids.float() * weights).sum()) > 0)


def _written_by_an_activation(ids, weights):
    mask = ids != 0
    first = mask[0]  # a view, made while its base's value was known
    mask.logical_and_(weights > 0)
    return bool(first.all())


def _random(ids, weights):
    return bool((torch.rand(ids.shape, device=ids.device) > 2).any())


def _empty(ids, weights):
    return int(torch.empty(ids.shape, dtype=torch.long, device=ids.device).sum())


def _too_large(ids, weights):
    return bool(torch.ones(LIMIT + 1, dtype=torch.bool, device=ids.device).all())


@pytest.mark.parametrize("read", [_activation, _written_by_an_activation, _random, _empty, _too_large])
def test_a_value_computed_from_anything_else_is_refused(read):
    """Weights and activations have no value on meta; nor has `empty`; a random value is not the trainer's; a
    tensor written in place from an activation has lost its value, and so have its views; a twin over LIMIT
    elements is not kept."""
    ids, value = torch.empty(1, 4, dtype=torch.long, device="meta"), torch.ones(1, 4, dtype=torch.long)
    weights = torch.empty(4, device="meta")  # made before the step, as the planner's weights are: no value
    with KnownValues() as known, pytest.raises(UnknownValue):
        known.know(ids, value)
        read(ids, weights)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_the_instruments_below_see_each_op_once():
    """The planner's memory tracker and roofline sit below the known values: the host's twins of an op must
    not reach them, or the plan would count each known op twice, and host memory the trainer never holds."""
    def program(ids):
        mask = ids != 0
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1]
        return mask.sum(), shifted * mask

    ids, value = torch.empty(2, 5, dtype=torch.long, device="meta"), torch.ones(2, 5, dtype=torch.long)
    with _Ops() as plain:
        program(ids)
    with _Ops() as below, KnownValues() as known:
        known.know(ids, value)
        program(ids)
    assert below.seen == plain.seen


class ReadsAnActivation(nn.Module):
    """A model that branches on an activation's value, which no batch determines."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 11)

    def forward(self, ids, targets):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        if h.abs().amax() > 1e3:  # the value read
            h = h / 1e3
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def test_a_model_that_reads_an_activation_is_refused_by_the_planner_in_one_line():
    def on_meta():
        with torch.device("meta"):
            return ReadsAnActivation()
    with pytest.raises(ValueError) as refused:
        simulate(Plan(model=on_meta, world_size=2, stage=3, micro_batch=1, seq=8, hardware="cpu-gloo"))
    said = str(refused.value)
    assert said.startswith("ReadsAnActivation's forward reads a value (test_known_values.py:"), said
    assert "\n" not in said


class SeesItsBatch(nn.Module):
    """A model that writes down which token ids its forward was given, as a model reading its padding mask
    would see them; its config names special ids, as a Hugging Face model's does."""

    def __init__(self, seen: list):
        super().__init__()
        self.config = SimpleNamespace(pad_token_id=0, bos_token_id=1, eos_token_id=[2, 3])
        self.embed = nn.Embedding(9, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 9)
        self.seen = seen

    def forward(self, ids, targets):
        self.seen.append(sorted(set(ids.flatten().tolist())))
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def test_the_planner_s_batch_is_full_rows_of_ordinary_tokens():
    """The planner plans the branch a trainer's packed batch takes: no row padded, so no pad id (and no other
    special id of the model's config) among the ids a forward that reads them sees."""
    seen = []

    def on_meta():
        with torch.device("meta"):
            return SeesItsBatch(seen)
    simulate(Plan(model=on_meta, world_size=2, stage=3, micro_batch=2, seq=8, hardware="cpu-gloo"))
    assert seen and all(ids == [4, 5, 6, 7, 8] for ids in seen), seen
