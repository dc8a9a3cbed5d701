"""Identical blocks simulated once: a step over 80 equal decoder layers is 80 repeats of one layer's work.

A model whose gathered units (its blocks, `default_units`) form runs of identical consecutive blocks is
simulated with each long run cut short, to `keep` blocks, then to keep + 1 and keep + 2. What one block
more adds, it adds to every sequence the planner reads as a run of items inserted into it:
- the memory tracker's samples, as changes (a block's allocations and frees, the same bytes at every
  depth; what follows them is shifted, not changed);
- the communicator's launches and waits, in order (a wait by how many launches back it refers to),
  each with the compute seconds since the item before;
- the roofline's sums (FLOPs, seconds by bound, host and link seconds) and the parameter count.
The inserted items are found by a diff of keep against keep + 1, and the fold is used only if
inserting them twice at the same places gives keep + 2 exactly (the memory and the collectives to the
byte, the times within rounding). Then the full length inserts them once per block more: the memory
timeline, each category's largest value and the peak are those of the whole step, read off that
timeline (never extrapolated as a peak, which can move from one moment of the step to another as
blocks are added). Where any check fails the step is simulated whole.

What makes two blocks identical: the same module classes, parameters and buffers (names, shapes, dtypes,
trainability) and plain attributes, a block's own index aside (`layer_idx` and the like).
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch.nn as nn

from zerofunc.plan.growth import ALIGNMENTS, Measured, grown, growth_of, measured, same, series, settled

# attributes that number a block in its stack and so differ between identical blocks
INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx", "index",
                              "site"})
MIN_SAVED = 3  # a run is folded only if its three short simulations skip at least this many of its blocks


def signature(block: nn.Module) -> tuple:
    """What two blocks must share to do the same work."""
    def plain(v) -> bool:
        return v is None or isinstance(v, (bool, int, float, str)) or (
            isinstance(v, tuple) and all(plain(x) for x in v))
    return tuple(
        (name, type(m).__name__,
         tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False)),
         tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False)),
         tuple(sorted((k, v) for k, v in vars(m).items()
                      if not k.startswith("_") and k not in INDEX_ATTRIBUTES and plain(v))))
        for name, m in block.named_modules())


def runs(blocks: nn.ModuleList) -> list[int]:
    """The lengths of the runs of identical consecutive blocks."""
    lengths, last = [], None
    for block in blocks:
        sig = signature(block)
        if lengths and sig == last:
            lengths[-1] += 1
        else:
            lengths.append(1)
        last = sig
    return lengths


def stack(model: nn.Module, units: list[str]) -> Optional[tuple[nn.Module, str, nn.ModuleList]]:
    """(parent, attribute, ModuleList) when the units are that list's blocks 0..n-1, in order; else None."""
    if not units or any("." not in u for u in units):
        return None
    prefix = units[0].rsplit(".", 1)[0]
    if units != [f"{prefix}.{i}" for i in range(len(units))]:
        return None
    parent_name, _, attr = prefix.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    blocks = getattr(parent, attr, None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) != len(units):
        return None
    return parent, attr, blocks


def in_flight(model: nn.Module, units: list[str], bucket_bytes: int) -> int:
    """How many blocks' collectives the step keeps in flight before it waits for the oldest, at most (the
    engine's queues of reductions, and of stages 1-2's new weights, hold up to `bucket_bytes`). Until that
    many blocks the step waits for nothing, and only after them does one block more add one wait: a run
    cut shorter would show the first pattern and be extended as if it held. A block's collectives are
    counted at 2 bytes per trained parameter, the least they can be, so the count errs high."""
    located = stack(model, units)
    trained = [sum(p.numel() for p in block.parameters() if p.requires_grad) for block in located[2]] if located else []
    smallest = min((t for t in trained if t), default=0)
    return bucket_bytes // (2 * smallest) if smallest else 0


def shortened(model: nn.Module, units: list[str], lengths: list[int],
              block_runs: Optional[list[int]] = None) -> nn.Module:
    """A copy of `model` with each run of its block stack cut to `lengths` (its first blocks kept); the model
    itself is left as it was. (A copy, not a new build: a 70B model on meta builds in 40 ms, its copy cut to
    a few blocks in 2.) `block_runs`: the stack's `runs`, where the caller has them."""
    parent, attr, blocks = stack(model, units)
    kept, start = [], 0
    for run, keep in zip(block_runs or runs(blocks), lengths):
        kept += [blocks[start + i] for i in range(keep)]
        start += run
    setattr(parent, attr, nn.ModuleList(kept))
    try:
        return copy.deepcopy(model)
    finally:
        setattr(parent, attr, blocks)


def fold(model: nn.Module, units: list[str], keep: int, measure: Callable[[list[int]], Measured],
         period: int = 1, block_runs: Optional[list[int]] = None) -> Optional[Measured]:
    """The step of `model` measured from short runs (the module's docstring); None where nothing folds or a
    check fails. `measure(lengths)` simulates the model with its runs cut to `lengths`. `period`: the blocks
    after which the step's pattern repeats (layer-selective AC recomputes one block in `period`): a run
    grows by that many blocks at a time, and is cut to a length that leaves the pattern of what follows it
    in place. `block_runs`: the stack's `runs`, where the caller has them."""
    located = stack(model, units)
    if located is None:
        return None
    full = block_runs or runs(located[2])
    short = [keep + (n - keep) % period for n in full]
    folded = [i for i, n in enumerate(full) if n - 3 * (short[i] + period) >= MIN_SAVED]
    if not folded:
        return None
    base_lengths = [short[i] if i in folded else n for i, n in enumerate(full)]
    base = series(measure(base_lengths))
    growths = []
    for i in folded:
        one, two = (series(measure([n + extra * period * (j == i) for j, n in enumerate(base_lengths)]))
                    for extra in (1, 2))
        for align in ALIGNMENTS:
            growth = growth_of(base, one, align)
            growth = growth and settled(base, growth, two)
            if growth is not None and same(grown(base, [(growth, 2)]), two):
                break
        else:
            return None
        growths.append((growth, (full[i] - short[i]) // period))
    if len(folded) > 1:  # the runs' blocks add independently: one more period in every run at once
        together = series(measure([n + period * (j in folded) for j, n in enumerate(base_lengths)]))
        if not same(grown(base, [(g, 1) for g, _ in growths]), together):
            return None
    return measured(grown(base, growths))
