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
import difflib
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch.nn as nn

from sim.ledger import LedgerEntry
from sim.memory import CATEGORIES

# attributes that number a block in its stack and so differ between identical blocks
INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx", "index",
                              "site"})
GAP_QUANTUM = 1e-9  # seconds
MIN_SAVED = 3  # a run is folded only if its three short simulations skip at least this many of its blocks


@dataclass
class Measured:
    """What one simulated step recorded, before it is priced."""
    numel: int
    labels: list[str]                      # the memory tracker's samples: the label of each
    live: np.ndarray                       # and its live bytes, device then host per category (a row each)
    ledger: list[LedgerEntry]
    events: list[tuple[str, int, float]]   # Ledger.events: (launch or wait, entry index, compute seconds)
    sums: dict[str, float] = field(default_factory=dict)  # flops, compute_s, elsewhere and by-bound seconds


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


def shortened(model: nn.Module, units: list[str], lengths: list[int]) -> nn.Module:
    """A copy of `model` with each run of its block stack cut to `lengths` (its first blocks kept); the model
    itself is left as it was. (A copy, not a new build: a 70B model on meta builds in 40 ms, its copy cut to
    a few blocks in 2.)"""
    parent, attr, blocks = stack(model, units)
    kept, start = [], 0
    for run, keep in zip(runs(blocks), lengths):
        kept += [blocks[start + i] for i in range(keep)]
        start += run
    setattr(parent, attr, nn.ModuleList(kept))
    try:
        return copy.deepcopy(model)
    finally:
        setattr(parent, attr, blocks)


def fold(model: nn.Module, units: list[str], keep: int, measure: Callable[[list[int]], Measured],
         period: int = 1) -> Optional[Measured]:
    """The step of `model` measured from short runs (the module's docstring); None where nothing folds or a
    check fails. `measure(lengths)` simulates the model with its runs cut to `lengths`. `period`: the blocks
    after which the step's pattern repeats (layer-selective AC recomputes one block in `period`): a run
    grows by that many blocks at a time, and is cut to a length that leaves the pattern of what follows it
    in place."""
    located = stack(model, units)
    if located is None:
        return None
    full = runs(located[2])
    short = [keep + (n - keep) % period for n in full]
    folded = [i for i, n in enumerate(full) if n - 3 * (short[i] + period) >= MIN_SAVED]
    if not folded:
        return None
    base_lengths = [short[i] if i in folded else n for i, n in enumerate(full)]
    base = _series(measure(base_lengths))
    growths = []
    for i in folded:
        one, two = (_series(measure([n + extra * period * (j == i) for j, n in enumerate(base_lengths)]))
                    for extra in (1, 2))
        for align in ALIGNMENTS:
            growth = _growth(base, one, align)
            growth = growth and _settle(base, growth, two)
            if growth is not None and _same(_grown(base, [(growth, 2)]), two):
                break
        else:
            return None
        growths.append((growth, (full[i] - short[i]) // period))
    if len(folded) > 1:  # the runs' blocks add independently: one more period in every run at once
        together = _series(measure([n + period * (j in folded) for j, n in enumerate(base_lengths)]))
        if not _same(_grown(base, [(g, 1) for g, _ in growths]), together):
            return None
    return _measured(_grown(base, growths))


# A Measured as series of (key, values): the key is compared exactly, the values are the numbers one block
# more may change. Memory: each change of the live bytes (label, device then host per category); collectives:
# the launch (with its entry) or the wait, with the compute seconds since the item before rounded to
# GAP_QUANTUM (the sums that make a gap differ in their last bits from one length to the next, ~1e-14 s at a
# 100 s step) and, for a wait, how many launches back its collective was, in the key to align the diff and
# among the values to change (the wait for the first of the reductions backward leaves running is a block's
# launches further back per block); sums: one item. Every key is shift-free: one block more inserts items and
# changes values, nothing else.
Series = dict[str, list[tuple[object, tuple]]]


def _series(m: Measured) -> Series:
    changes = np.diff(m.live, axis=0, prepend=np.zeros((1, m.live.shape[1]), dtype=m.live.dtype))
    memory = [((label, change), ()) for label, change in zip(m.labels, map(tuple, changes.tolist()))]
    comm, launched, at = [], 0, 0.0
    if m.events:
        for kind, index, t in m.events:
            if kind == "launch":
                comm.append(((("launch", m.ledger[index]), round((t - at) / GAP_QUANTUM), 0), (t - at, 0)))
                launched += 1
            else:
                back = launched - index
                comm.append(((("wait",), round((t - at) / GAP_QUANTUM), back), (t - at, back)))
            at = t
        if launched != len(m.ledger):
            raise ValueError("a collective without its launch event: the schedule cannot be folded")
    else:
        comm = [((("launch", e), 0, 0), (0.0, 0)) for e in m.ledger]
    return {"memory": memory, "comm": comm,
            "sums": [(("sums", tuple(m.sums), len(m.events) > 0), (float(m.numel), *m.sums.values()))]}


ALIGNMENTS = (lambda key: key, lambda key: (key[0], key[2]), lambda key: key[0])  # a collective by all it
# carries, without its gap, by what it is alone: the first whose growth two blocks more confirm is taken


def _growth(base: Series, longer: Series, align=ALIGNMENTS[0]) -> Optional[dict]:
    """Per series, the items `longer` inserts into `base` ({position in base: [items]}, each list repeated per
    block; `_settle` may split it) and the base items whose values it changes ({position: differences});
    None unless that is all it does."""
    out = {}
    for name in base:
        a, b = ([align(key) if name == "comm" else key for key, _ in seq[name]] for seq in (base, longer))
        inserts, changes = {}, {}

        def pair(i: int, j: int) -> None:
            if base[name][i][1] != longer[name][j][1]:
                changes[i] = _sub(longer[name][j][1], base[name][i][1])
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if tag == "equal":
                for n in range(i2 - i1):
                    pair(i1 + n, j1 + n)
            elif tag == "insert":
                inserts[i1] = [longer[name][j1:j2]]
            elif tag == "replace":
                # items whose values changed (a collective's gap or a wait's distance: its key holds both), and
                # beside them, before or after, any items inserted
                k, mine = i2 - i1, [_identity(name, key) for key in a[i1:i2]]
                if j2 - j1 >= k and mine == [_identity(name, key) for key in b[j1:j1 + k]]:
                    paired, (at, first, last) = j1, (i2, j1 + k, j2)
                elif j2 - j1 > k and mine == [_identity(name, key) for key in b[j2 - k:j2]]:
                    paired, (at, first, last) = j2 - k, (i1, j1, j2 - k)
                else:
                    return None
                for n in range(k):
                    pair(i1 + n, paired + n)
                if last > first:
                    inserts[at] = [longer[name][first:last]]
            else:
                return None
        out[name] = (inserts, changes)
    return out


def _settle(base: Series, growth: dict, two: Series) -> Optional[dict]:
    """`growth` with each insertion in the form that two blocks more give: the items repeated as one piece,
    or split by `_sides` (left to right, each site checked against `two`); None where neither does."""
    for name, items in base.items():
        inserts = growth[name][0]
        target, at = [_identity(name, key) for key, _ in two[name]], 0
        for i in range(len(items) + 1):
            if i in inserts:
                whole = [item for piece in inserts[i] for item in piece]
                for pieces in ([whole], list(_sides(items, i, whole))):
                    grown = [_identity(name, key) for piece in pieces for key, _ in piece * 2]
                    if grown == target[at:at + len(grown)]:
                        inserts[i], at = pieces, at + len(grown)
                        break
                else:
                    return None
            at += i < len(items)
    return growth


def _sides(items: list, at: int, inserted: list) -> tuple[list, list, list]:
    """An insertion before items[at], as (what repeats the item on its left, the rest, what repeats the item
    on its right). A block more frees one more buffer in a run of frees and one more activation in the run
    after it: the diff inserts [buffer, activation] between the runs, and two blocks more must give two of
    each, not the pair twice."""
    left = items[at - 1] if at > 0 else None
    right = items[at] if at < len(items) else None
    p = 0
    while p < len(inserted) and inserted[p] == left:
        p += 1
    q = len(inserted)
    while q > p and inserted[q - 1] == right:
        q -= 1
    return inserted[:p], inserted[p:q], inserted[q:]


def _grown(base: Series, growths: list[tuple[dict, int]]) -> Series:
    """`base` with each growth applied `times` times: its items inserted, its changes scaled."""
    out = {}
    for name, items in base.items():
        seq = []
        for i in range(len(items) + 1):
            for growth, times in growths:
                for piece in growth[name][0].get(i, ()):
                    seq += piece * times
            if i == len(items):
                break
            key, values = items[i]
            for growth, times in growths:
                change = growth[name][1].get(i)
                if change is not None:
                    values = tuple(v + times * d for v, d in zip(values, change))
            seq.append((key, values))
        out[name] = seq
    return out


def _identity(name: str, key) -> object:
    """What an item is, apart from the rounded gap a collective's key carries to align the diff."""
    return key[0] if name == "comm" else key


def _same(a: Series, b: Series) -> bool:
    """The same items, a wait for the same collective, and the seconds and sums within their rounding."""
    for name in a:
        if [_identity(name, k) for k, _ in a[name]] != [_identity(name, k) for k, _ in b[name]]:
            return False
        for (_, u), (_, v) in zip(a[name], b[name]):
            if name == "comm" and u[1] != v[1]:
                return False
            if not all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(u, v)):
                return False
    return True


def _measured(series: Series) -> Measured:
    labels = [label for (label, _), _ in series["memory"]]
    changes = np.array([change for (_, change), _ in series["memory"]], dtype=np.int64).reshape(
        len(labels), 2 * len(CATEGORIES))
    ledger, events, at = [], [], 0.0
    for (what, *_), (gap, back) in series["comm"]:
        at += gap
        if what[0] == "launch":
            ledger.append(what[1])
            events.append(("launch", len(ledger) - 1, at))
        else:
            events.append(("wait", len(ledger) - back, at))
    (_, names, timed), (numel, *sums) = series["sums"][0]
    return Measured(int(round(numel)), labels, np.cumsum(changes, axis=0), ledger, events if timed else [],
                    dict(zip(names, sums)))


def _sub(a: tuple, b: tuple) -> tuple:
    return tuple(x - y for x, y in zip(a, b))


def _add(a: tuple, b: tuple) -> tuple:
    return tuple(x + y for x, y in zip(a, b))
