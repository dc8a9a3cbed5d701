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
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn

_ABSENT = object()


# Each model's parameter names -> (the module that holds it, its attribute), found once: a block is bound and
# unbound at each of its runs, and `get_submodule` walking a name's path cost 7 us a parameter (88 us a GPT-2
# block, 24 of them a micro-step of 12 blocks). The engine's units fix the modules they bind at initialize.
_SLOTS: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[nn.Module, str]]] = weakref.WeakKeyDictionary()


def bind(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put `tensors` in place of the model's parameters of those names; return what they replaced."""
    slots = _SLOTS.get(model)
    if slots is None:
        slots = _SLOTS[model] = {}
    replaced = {}
    for name, t in tensors.items():
        slot = slots.get(name)
        if slot is None:
            path, _, attr = name.rpartition(".")
            slot = slots[name] = (model.get_submodule(path), attr)
        owner, attr = slot
        replaced[name] = owner._parameters[attr]
        owner._parameters[attr] = t
    return replaced


def with_ties(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """What gives tensors named as `model.named_parameters()` names them every name their parameter has: a
    parameter two modules share (a head tied to its embedding) has one name there and one in each module.
    `functional_call` finds those itself (tie_weights) by walking the whole model at each call, a third of a
    12-block step's Python calls; here they are found once."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied = {aliases[0]: aliases for aliases in names.values() if len(aliases) > 1}
    return lambda tensors: {a: t for n, t in tensors.items() for a in tied.get(n, (n,))}


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
