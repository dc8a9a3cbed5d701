"""zerofunc/tape.py: a forward cut into segments, differentiated one segment at a time in reverse, gives
every weight the gradient `loss.backward()` gives it, bit for bit in fp32 (the same terms summed in the
same order: no tolerance to derive), for zerofunc's models and Hugging Face's, and for glue that keeps
tensors across blocks."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

from zerofunc.models import build_model, model_config
from zerofunc.tape import Tape


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}


def one_graph(model, weights, args, kwargs) -> dict[str, torch.Tensor]:
    loss = loss_from(functional_call(model, weights, args, kwargs))
    loss.backward()
    return {n: w.grad for n, w in weights.items()}


def segmented(model, weights, args, kwargs, blocks: list[str], as_the_engine: bool) -> tuple[dict, list]:
    """The tape's gradients, and the segments (in forward order) that gave each weight one.

    `as_the_engine`: as zerofunc/engine.py cuts a forward: a block's end opens a segment too, and each
    block runs through `tape.unseen` (its inside not watched); else the tape watches every operation
    and cuts only where blocks start."""
    tape = Tape()
    modules = [model.get_submodule(b) for b in blocks]
    hooks = [m.register_forward_pre_hook(lambda m, a, b=b: tape.open(b) and None) for m, b in zip(modules, blocks)]
    if as_the_engine:
        hooks += [m.register_forward_hook(lambda m, a, o: tape.open(None) and None) for m in modules]
        for m in modules:
            m.forward = lambda *args, f=m.forward, **kwargs: tape.unseen(f, args, kwargs)
    try:
        with tape:
            loss = loss_from(functional_call(model, weights, args, kwargs))
    finally:
        for h in hooks:
            h.remove()
        for m in modules:
            m.__dict__.pop("forward", None)
    tape.seed(loss, torch.ones_like(loss))
    names, grads, used = list(weights), {}, {n: [] for n in weights}
    for segment in reversed(tape.segments):
        for n, g in zip(names, tape.grad(segment, [weights[n] for n in names])):
            if g is not None:
                grads[n] = g if n not in grads else grads[n] + g
                used[n].append(segment.unit)
    return grads, used


def loss_from(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def assert_bitwise(model, args, kwargs, blocks, as_the_engine: bool) -> dict:
    expected = one_graph(model, weights_of(model), args, kwargs)
    got, used = segmented(model, weights_of(model), args, kwargs, blocks, as_the_engine)
    assert got.keys() == {n for n, g in expected.items() if g is not None}
    for n, g in got.items():
        assert torch.equal(g, expected[n]), f"{n}: {(g - expected[n]).abs().max():.3g} from loss.backward()'s"
    return used


AS_THE_ENGINE = pytest.mark.parametrize("as_the_engine", [False, True], ids=["watched", "as-the-engine"])


@AS_THE_ENGINE
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_zerofunc_models(name, as_the_engine):
    torch.manual_seed(0)
    cfg = model_config(name)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    used = assert_bitwise(model, (ids, ids.roll(-1, 1)), {}, model.shard_units(), as_the_engine)
    block0 = model.shard_units()[0]
    assert {u for n, segs in used.items() if n.startswith(block0 + ".") for u in segs} == {block0}
    if name.startswith("gpt2"):  # the tied head hands its gradient back to the embedding, in the first segment
        assert used["wte.weight"] == [None]


@AS_THE_ENGINE
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hugging_face_models(family, as_the_engine):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=3, n_head=3, n_embd=27, vocab_size=53, n_positions=32, bos_token_id=0, eos_token_id=0))
        blocks = [f"transformer.h.{i}" for i in range(3)]
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=3, hidden_size=30, intermediate_size=41, num_attention_heads=3, num_key_value_heads=1,
            vocab_size=53, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True))
        blocks = [f"model.layers.{i}" for i in range(3)]
    model.eval()  # dropout off: the two runs would draw different masks
    ids = torch.randint(0, 53, (2, 11))
    assert_bitwise(model, (), {"input_ids": ids, "labels": ids}, blocks, as_the_engine)


class Glue(nn.Module):
    """Glue that keeps tensors across blocks: a residual stream summed outside the blocks, a learned
    bias made before the first block and read by every block, and a root weight between blocks."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.bias = nn.Parameter(torch.randn(7))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(7, 7), nn.Tanh()) for _ in range(3))
        self.mix = nn.Linear(7, 7)
        self.out = nn.Linear(7, 1)

    def forward(self, x):
        h = self.inp(x)
        shift = self.bias * 2  # made in the first segment, taken by every later one
        stream = h
        for block in self.blocks:
            h = block(h + shift)
            stream = stream + self.mix(h)  # the glue's own weight, between blocks
        return (self.out(stream * h) ** 2).mean()


@AS_THE_ENGINE
def test_glue_that_keeps_tensors_across_blocks(as_the_engine):
    torch.manual_seed(0)
    model = Glue()
    used = assert_bitwise(model, (torch.randn(4, 5),), {}, [f"blocks.{i}" for i in range(3)], as_the_engine)
    assert used["bias"] == [None]  # `shift`'s gradient handed back to the first segment from every later one
    # the glue between blocks: in the segment a block opened, or (as the engine cuts) in one of its own
    assert used["mix.weight"] == ([None] * 3 if as_the_engine else ["blocks.2", "blocks.1", "blocks.0"])
    assert used["blocks.1.0.weight"] == ["blocks.1"]


class Shifted(nn.Module):
    """A block that reads `shift`, set on it by the model, as a module attribute."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(7, 7)

    def forward(self, h):
        return torch.tanh(self.linear(h + self.shift))


class ReadsAnAttribute(Glue):
    """Blocks that read a tensor of an earlier segment through a module attribute, not an argument."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Shifted() for _ in range(3))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            block.shift = self.bias * 2
            h = block(h)
        return self.out(h).sum()


class Kept(nn.Module):
    """A block that keeps a tensor made from its input as an attribute, besides returning its output."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(7, 7)

    def forward(self, h):
        self.kept = h * 3
        return torch.tanh(self.linear(h))


class ReadsWhatABlockKept(Glue):
    """Glue that reads, after a block, what the block kept (a cache, an attention map stored for later)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Kept() for _ in range(3))

    def forward(self, x):
        h, extra = self.inp(x), 0
        for block in self.blocks:
            h = block(h)
            extra = extra + block.kept.sum()
        return self.out(h).sum() + extra


@AS_THE_ENGINE
def test_what_a_block_keeps_belongs_to_the_block(as_the_engine):
    """Unwatched, a block's kept tensor is tagged by no one: the tape finds its segment by walking back to
    the block's input, a leaf of the block's segment."""
    torch.manual_seed(0)
    assert_bitwise(ReadsWhatABlockKept(), (torch.randn(4, 5),), {}, [f"blocks.{i}" for i in range(3)], as_the_engine)


def test_a_block_reading_an_earlier_tensor_past_its_arguments_is_refused():
    """Unwatched, a block's inside could join its graph to an earlier segment's; the tape refuses the read."""
    torch.manual_seed(0)
    model = ReadsAnAttribute()
    blocks = [f"blocks.{i}" for i in range(3)]
    segmented(model, weights_of(model), (torch.randn(4, 5),), {}, blocks, as_the_engine=False)  # watched: fine
    with pytest.raises(ValueError, match="read a tensor made before it other than through its arguments"):
        segmented(model, weights_of(model), (torch.randn(4, 5),), {}, blocks, as_the_engine=True)


class Doubled(torch.autograd.Function):
    """A custom Function, whose `apply` no torch function mode sees."""

    @staticmethod
    def forward(ctx, a, b):
        return a * 2 + b

    @staticmethod
    def backward(ctx, g):
        return g * 2, g


class Unseen(Glue):
    """Calls the tape does not see, taking the previous block's output: a custom Function and code run
    with torch functions disabled; and, with `join`, a Function taking tensors of two segments."""

    def __init__(self, join: bool):
        super().__init__()
        self.join = join

    def forward(self, x):
        first = h = self.inp(x)
        for block in self.blocks:
            with torch._C.DisableTorchFunction():
                h = h * 1.5
            h = block(Doubled.apply(h, first if self.join else h))
        return self.out(h).sum()


@AS_THE_ENGINE
def test_calls_the_tape_does_not_see_are_placed_by_their_inputs(as_the_engine):
    torch.manual_seed(0)
    assert_bitwise(Unseen(join=False), (torch.randn(4, 5),), {}, [f"blocks.{i}" for i in range(3)], as_the_engine)


def test_an_unseen_call_joining_two_segments_is_refused():
    torch.manual_seed(0)
    model = Unseen(join=True)
    with pytest.raises(ValueError, match="DoubledBackward .*different blocks: call it through zerofunc.tape.overridable"):
        segmented(model, weights_of(model), (torch.randn(4, 5),), {}, [f"blocks.{i}" for i in range(3)], False)


def test_the_loss_must_come_from_the_tape():
    tape = Tape()
    with pytest.raises(ValueError, match="not computed inside"):
        tape.seed(torch.ones(()), torch.ones(()))
