"""The tensors inside an op's arguments or results: a lean stand-in for torch's pytree.

Op arguments and results nest only tuples, lists and dicts. The instruments walk them
for every op of a simulated step (tens of thousands for a 70B model), where the
general pytree machinery costs more than the meta kernels themselves.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch


def tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensors(y)
