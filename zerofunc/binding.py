"""How the engine enters the caller's model for one call, and leaves it as it found it.

The model's own forward calls its blocks, so the engine reaches a block only through the block: its
views are bound in place of the module's parameters while it runs (`bind`), and its forward and hooks
(the engine's gather, bind and release; a compiled or checkpointed forward) are set in the caller's
modules only while the engine's forward or backward runs (`installed`: backward calls a block again when
the model checkpoints its own blocks). Between the engine's calls the module is the
caller's as it was: no hook, no forward of the engine's, no attribute changed. Its weights excepted:
`zerofunc.initialize` moves them into the engine's flat buffers (the module keeps meta tensors in their
place), as DeepSpeed's ZeRO-3 and FSDP2 replace them in place, since keeping both copies would double
the memory of the model the engine exists to fit.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn

_ABSENT = object()


@dataclass
class _Found:
    """What binding needs of a model's structure, found once per model: a block is bound and unbound at each of
    its runs, and `get_submodule` walking a name's path cost 7 us a parameter (88 us a GPT-2 block, 24 of them a
    micro-step of 12 blocks); `functional_call` finding tied weights itself (tie_weights) walked the whole model
    at each call, a third of a 12-block step's Python calls. The engine's units fix the modules at initialize."""

    slots: dict[str, tuple[nn.Module, str]]  # every name of every parameter -> (the module holding it, attribute)
    tied: dict[str, list[str]]  # a parameter two modules share (a head tied to its embedding): first name -> all


_FOUND: weakref.WeakKeyDictionary[nn.Module, _Found] = weakref.WeakKeyDictionary()


def _found(model: nn.Module) -> _Found:
    found = _FOUND.get(model)
    if found is None:
        slots, names = {}, {}
        for path, module in model.named_modules(remove_duplicate=False):  # named_parameters' order and names
            for attr, p in module._parameters.items():
                if p is not None:
                    name = f"{path}.{attr}" if path else attr
                    slots[name] = (module, attr)
                    names.setdefault(id(p), []).append(name)
        found = _FOUND[model] = _Found(slots, {a[0]: a for a in names.values() if len(a) > 1})
    return found


def bind(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put `tensors` in place of the model's parameters of those names; return what they replaced."""
    slots, replaced = _found(model).slots, {}
    for name, t in tensors.items():
        owner, attr = slots[name]
        replaced[name] = owner._parameters[attr]
        owner._parameters[attr] = t
    return replaced


def with_ties(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors`, named as `model.named_parameters()` names them, under every name their parameter has: for
    `functional_call(..., tie_weights=False)`, which then need not find the tied ones itself."""
    tied = _found(model).tied
    return {a: t for n, t in tensors.items() for a in tied.get(n, (n,))}


@contextlib.contextmanager
def installed(forwards: Mapping[nn.Module, Callable], pre_hooks: Mapping[nn.Module, Callable] = {},
              post_hooks: Mapping[nn.Module, Callable] = {},
              settings: Sequence[tuple[Any, str, Any]] = ()) -> Iterator[None]:
    """Within: each module's `forwards` in place of its own, its pre- and post-forward hooks registered, and
    each (object, attribute, value) of `settings` set. After, even on an error: each module as it was (an
    instance's own forward or attribute, if it had one, back; else the class's again)."""
    saved, handles = [], []
    try:
        for obj, name, value in [(m, "forward", f) for m, f in forwards.items()] + list(settings):
            saved.append((obj, name, obj.__dict__.get(name, _ABSENT)))
            setattr(obj, name, value)
        handles += [m.register_forward_pre_hook(h) for m, h in pre_hooks.items()]
        handles += [m.register_forward_hook(h) for m, h in post_hooks.items()]
        yield
    finally:
        for handle in handles:
            handle.remove()
        for obj, name, old in reversed(saved):
            if old is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
