"""Flat layout: a unit's parameters packed into one buffer that splits into equal shards.

The buffer is padded so that it divides into `world_size` contiguous shards of equal
length, each a multiple of ALIGN elements. Balancing is by element, not by tensor: a
parameter may straddle two ranks.
Every collective then moves one contiguous buffer per unit, and a rank's optimizer
state is simply the slice of that buffer it owns.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

# Every shard is a multiple of 16 elements (at most 15 of padding per rank). The fused kernels'
# 128-bit loads (ld.global.v4) need 16-byte alignment of every block they read, and Triton gives
# a kernel that hint only for an element count divisible by 16 and pointers 16-byte aligned:
# a rank's shard of the whole buffer starts at rank * shard_numel elements, so 16 fp32 elements
# (64 B) keep every shard aligned in every dtype. Without it, a shard of, say, 66091 elements
# compiles to scalar loads (docs/CUDA.md, "Compiled ahead of time on a CPU machine").
ALIGN = 16


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[Slot, ...]
    world_size: int

    @classmethod
    def build(cls, named_shapes: Sequence[tuple[str, Sequence[int]]], world_size: int) -> "FlatLayout":
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        slots, offset = [], 0
        for name, shape in named_shapes:
            slot = Slot(name, tuple(int(s) for s in shape), offset)
            slots.append(slot)
            offset += slot.numel
        return cls(tuple(slots), world_size)

    def __post_init__(self):
        self._split_sizes  # noqa: B018  (cached now, so that a compiled step's trace only reads it)

    # Cached (the layout is frozen): a block's views are taken at each of its runs, and these sums over its
    # slots were a third of that Python.
    @functools.cached_property
    def numel(self) -> int:
        """Parameter elements, without padding."""
        return sum(s.numel for s in self.slots)

    @functools.cached_property
    def shard_numel(self) -> int:
        """Elements per rank: ceil(numel / world_size), rounded up to a multiple of ALIGN."""
        return -(-self.numel // (self.world_size * ALIGN)) * ALIGN

    @functools.cached_property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @functools.cached_property
    def _split_sizes(self) -> list[int]:
        """Each parameter's elements, then the padding's: how `views` splits a full buffer."""
        return [s.numel for s in self.slots] + [self.padded_numel - self.numel]

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The [start, stop) of the flat buffer that `rank` owns."""
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter as a view into `flat` (a full, padded buffer).

        One `split` rather than one slice per parameter: its backward concatenates the
        parameter gradients into one unit-sized gradient instead of allocating a
        unit-sized zero tensor per parameter.
        """
        if flat.numel() != self.padded_numel:
            raise ValueError(f"flat buffer has {flat.numel()} elements, layout needs {self.padded_numel}")
        pieces = flat.split(self._split_sizes)
        return {s.name: p.view(s.shape) for s, p in zip(self.slots, pieces)}

    def pieces(self, start: int, stop: int) -> Iterator[tuple[Slot, int, int, int]]:
        """For each parameter overlapping [start, stop) of the flat buffer: (slot, lo, hi, at).

        Elements [lo, hi) of the flattened parameter fall in the range, at offset `at`
        from `start`. Used to materialize only the part of the model a rank keeps.
        """
        for slot in self.slots:
            lo = max(start, slot.offset)
            hi = min(stop, slot.offset + slot.numel)
            if lo < hi:
                yield slot, lo - slot.offset, hi - slot.offset, lo - start

    def owned_pieces(self, rank: int) -> Iterator[tuple[Slot, int, int, int]]:
        """`pieces` of `rank`'s shard."""
        return self.pieces(*self.shard_range(rank))


def shard(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous shard of a padded flat buffer (a view, no copy)."""
    if flat.numel() % world_size:
        raise ValueError(f"{flat.numel()} elements do not split into {world_size} equal shards")
    n = flat.numel() // world_size
    return flat[rank * n:(rank + 1) * n]


def unshard(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full flat buffer from every rank's shard, in rank order."""
    sizes = {s.numel() for s in shards}
    if len(sizes) > 1:
        raise ValueError(f"shards differ in size: {sorted(sizes)}")
    return torch.cat([s.reshape(-1) for s in shards])
