"""Remember what meta kernels return, so a model of 80 identical layers runs each op's meta kernel once.

A meta kernel computes only the output's shape, strides and dtype, often through
Python decompositions that cost more than the op itself would on the device. A
transformer repeats the same ops on the same shapes in every layer, so the planner
caches: an op whose arguments match an earlier call (every tensor's layout, every
other value) gets fresh empty tensors of the remembered layouts. Only ops that are
safe to answer that way are cached: on meta tensors, not views, not in-place or out=
ops, not ops whose result turns out to share an input's storage, and with results that are tensors or tuples of them.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sim.tensors import tensors

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Uncacheable(Exception):
    pass


def _key(x):
    if isinstance(x, torch.Tensor):
        if x.device.type != "meta":
            raise _Uncacheable
        return (x.shape, x.stride(), x.dtype, x.storage_offset())
    if isinstance(x, (tuple, list)):
        return (type(x), *(_key(y) for y in x))
    if isinstance(x, _PLAIN):
        return (type(x), x)
    raise _Uncacheable


def _layout(out):
    """How to make `out` again: a layout per tensor, tuples kept; None if `out` is anything else."""
    if isinstance(out, torch.Tensor):
        return (tuple(out.shape), out.stride(), out.dtype) if out.device.type == "meta" else None
    if isinstance(out, tuple):
        parts = [_layout(o) for o in out]
        return None if any(p is None for p in parts) else ("tuple", parts)
    return None


def _aliases(out, inputs) -> bool:
    """Whether a result shares storage with an input (`_unsafe_view` does, though its schema says not)."""
    held = {t.untyped_storage()._cdata for t in tensors(inputs)}
    return any(t.untyped_storage()._cdata in held for t in tensors(out))


def _remake(layout):
    if layout[0] == "tuple":
        return tuple(_remake(p) for p in layout[1])
    shape, stride, dtype = layout
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


class MetaKernelCache(TorchDispatchMode):
    """Enter it first (outermost), so it sits just above the kernels, below every instrument."""

    def __init__(self):
        super().__init__()
        self._layouts: dict = {}
        self._pure: dict = {}  # op -> whether its schema promises fresh results (not a view, not in place)
        self.hits = self.misses = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pure = self._pure.get(func)
        if pure is None:
            schema = func._schema
            pure = self._pure[func] = not (func.is_view or schema.is_mutable
                                           or any(r.alias_info is not None for r in schema.returns))
        if not pure:
            return func(*args, **kwargs)
        try:
            key = (func, _key(args), tuple((k, _key(v)) for k, v in kwargs.items()))
        except _Uncacheable:
            return func(*args, **kwargs)
        layout = self._layouts.get(key)
        if layout is not None:
            self.hits += 1
            return _remake(layout)
        self.misses += 1
        out = func(*args, **kwargs)
        layout = _layout(out)
        if layout is not None and not _aliases(out, (args, kwargs)):
            self._layouts[key] = layout
        return out
