"""How a unit's flat buffer enters the model and the autograd graph: its views bound in place of the
module's parameters (`bind`), through an identity whose backward hands the unit's whole gradient to
the engine (`UnitBoundary`)."""
from __future__ import annotations

import torch
import torch.nn as nn


class UnitBoundary(torch.autograd.Function):
    """Identity on the unit's buffer in forward; hands the unit's gradient to the engine in backward.

    Its input is a shared empty `anchor` that requires grad, so the graph runs through
    every unit without the buffers themselves being autograd leaves: the engine, not
    autograd, decides where gradients are stored.
    """

    @staticmethod
    def forward(ctx, anchor, engine, unit):
        ctx.engine, ctx.unit = engine, unit
        return unit.full.view_as(unit.full)

    @staticmethod
    def backward(ctx, grad):
        ctx.engine.unit_gradient(ctx.unit, grad)
        return None, None, None


def bind(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put `tensors` in place of the model's parameters of those names; return what they replaced."""
    replaced = {}
    for name, t in tensors.items():
        path, _, attr = name.rpartition(".")
        owner = model.get_submodule(path)
        replaced[name] = owner._parameters[attr]
        owner._parameters[attr] = t
    return replaced
