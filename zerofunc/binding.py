"""How a unit's flat buffer enters the model: its views bound in place of the module's parameters while
its block runs (`bind`), since the model's own forward, not the engine, calls the block."""
from __future__ import annotations

import torch
import torch.nn as nn


def bind(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put `tensors` in place of the model's parameters of those names; return what they replaced."""
    replaced = {}
    for name, t in tensors.items():
        path, _, attr = name.rpartition(".")
        owner = model.get_submodule(path)
        replaced[name] = owner._parameters[attr]
        owner._parameters[attr] = t
    return replaced
