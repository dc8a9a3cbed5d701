"""What a step on meta tensors knows of values: the batch's, and what is computed from it alone.

A simulated step runs on meta tensors, which have shapes and no values. Some models read a value in
their forward, and take a branch by it: Hugging Face's masking utilities ask whether the padding mask
is all ones, to leave SDPA without a mask (BART's decoder builds a mask of ones, T5Gemma compares the
token ids with its pad id). Such a value is the batch's, not the weights': on a batch like the
planner's (full rows, no padding) the trainer takes the branch it gives. So `KnownValues` keeps a
twin on the host for each small meta tensor computed from known tensors alone (the batch, once given
its values with `know`; factories such as `torch.ones`; host tensors), made by running the same op on
the twins, and answers a value read of such a tensor (`.item()`, `if t.all()`, `.tolist()`, an
output shape that depends on values, as `nonzero`'s) from its twin. A read of any other tensor, one
computed from weights or activations, which have no values on meta, raises `UnknownValue`.

No twin is made of an output over `LIMIT` elements (a long sequence's causal mask: twins stay cheap),
of an op whose result has no defined value (`empty`) or a random one (`rand`, dropout), nor of an op
that writes a host tensor. A meta tensor written in place by an op of unknown values loses its twin,
and so do its views: a twin holds only at the version (`_version`, which views share) it was made at.
Twins are computed with every dispatch mode off, so the planner's instruments (memory, roofline) see
the step's ops once, as the trainer runs them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from sim.tensors import tensors

LIMIT = 2**22  # elements of one twin: at most 32 MiB of int64 on the host

aten = torch.ops.aten
_NO_VALUE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
             aten.new_empty_strided.default}


class UnknownValue(RuntimeError):
    """A step on meta tensors read the value of a tensor whose value is not known."""


def _reads(func, kwargs) -> bool:
    """Whether `func` may need its inputs' values: for a Python number or bool (`item`, `equal`), an output
    shape that depends on them (`nonzero`; an index by integers has none, and its meta kernel runs), or a copy
    off the meta device (`tolist`, `.cpu()`)."""
    if torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags:
        return True
    device = kwargs.get("device")
    return func is aten._to_copy.default and device is not None and torch.device(device).type != "meta"


def _written(func, args, kwargs) -> list:
    """The arguments `func` writes in place (an in-place or out= op's)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    given = dict(zip((a.name for a in schema.arguments), args)) | kwargs
    return [given.get(a.name) for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]


class KnownValues(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._twins = WeakIdKeyDictionary()  # meta tensor -> (its twin on the host, its _version then)

    def know(self, t: torch.Tensor, value: torch.Tensor) -> None:
        """Take `value` (on the host) as the meta tensor `t`'s."""
        if value.shape != t.shape or value.dtype != t.dtype:
            raise ValueError(f"a value of {tuple(value.shape)} {value.dtype} for a tensor of {tuple(t.shape)} "
                             f"{t.dtype}")
        self._twins[t] = (value.cpu(), t._version)

    def value_of(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """`t`'s value on the host, if known: a host tensor's own, a meta tensor's twin if it has not been written
        since, else None."""
        if t.device.type != "meta":
            return t
        twin = self._twins.get(t)
        return twin[0] if twin is not None and twin[1] == t._version else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        twin_of = {id(t): self.value_of(t) for t in tensors((args, kwargs))}  # each input's twin, by the input
        twins = list(twin_of.values())
        written = list(tensors(_written(func, args, kwargs)))
        known = (all(t is not None for t in twins) and func not in _NO_VALUE
                 and torch.Tag.nondeterministic_seeded not in func.tags and all(
                     t.device.type == "meta" for t in written))  # a host tensor written would be written twice
        versions = [t._version for t in written]  # before the op writes them
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:  # as a meta kernel refuses a read of values it has not
            if not _reads(func, kwargs):
                raise
            if not known:
                raise UnknownValue(f"{func} read the value of a tensor computed from others with none on meta") from e
            return self._read(func, args, kwargs, twin_of)
        if known and all(o.numel() <= LIMIT for o in tensors(out) if o.device.type == "meta"):
            self._twin(func, args, kwargs, twin_of, out, written, versions)
        return out

    def _on_twins(self, func, args, kwargs, twin_of):
        """`func` run on the host, each input replaced by its twin (`twin_of`), with every dispatch mode off."""
        def host(x):
            if isinstance(x, torch.Tensor):
                return twin_of[id(x)]
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            if isinstance(x, (tuple, list)):
                return type(x)(host(y) for y in x)
            return x
        with _disable_current_modes():
            return func(*host(args), **{k: host(v) for k, v in kwargs.items()})

    def _twin(self, func, args, kwargs, twin_of, out, written, versions) -> None:
        try:
            result = self._on_twins(func, args, kwargs, twin_of)
        except (RuntimeError, NotImplementedError, IndexError):  # the host refuses what meta took (an id past a
            return  # table's end): no twin, and those written have none from here on (their version moved)
        self._written_alike(written, versions, [twin_of[id(w)] for w in written])
        # a view's twin is a view of its base's, so that a write reaches both; the view shares its base's version
        # once it returns through autograd's view kernel, above this mode
        version = args[0]._version if func.is_view else 0
        for o, r in zip(tensors(out), tensors(result)):
            if o.device.type == "meta" and id(o) not in twin_of:  # not an input written in place, which holds its own
                self._twins[o] = (r, version)

    def _written_alike(self, written, versions, twins) -> None:
        """Each tensor of `written` was written in place (at version `versions`) and its twin alike: every tensor
        holding a twin valid then, in the same storage on meta and on the host (its views, made by view ops from
        its twin; a slice assignment writes a view), holds it valid at the next version, which they share. The
        op counts it as it returns through autograd's in-place kernel, above this mode: one more."""
        for w, before, twin in zip(written, versions, twins):
            storage, twin_storage = w.untyped_storage()._cdata, twin.untyped_storage()._cdata
            alike = [(t, value) for t, (value, version) in self._twins.items()
                     if version == before and t.untyped_storage()._cdata == storage
                     and value.untyped_storage()._cdata == twin_storage]
            for t, value in alike:
                self._twins[t] = (value, before + 1)

    def _read(self, func, args, kwargs, twin_of):
        try:
            result = self._on_twins(func, args, kwargs, twin_of)
        except (RuntimeError, NotImplementedError, IndexError) as e:
            raise UnknownValue(f"{func} read a value its inputs' known values do not give: {e}") from e
        if torch.Tag.dynamic_output_shape not in func.tags:
            return result  # a Python value, or a copy on the host
        # a meta result of the shape the values give, allocated with the instruments watching, and its twin
        made = []
        for r in (result if isinstance(result, tuple) else (result,)):
            o = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="meta")
            self._twins[o] = (r, o._version)
            made.append(o)
        return tuple(made) if isinstance(result, tuple) else made[0]
