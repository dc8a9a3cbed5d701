"""What one block more adds to a simulated step (zerofunc.plan.folding reads it): a step's record as series of
items, the diff of two records into the items one inserts and the values it changes, and the record of a step
with those applied any number of times."""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from sim.ledger import LedgerEntry
from sim.memory import CATEGORIES

GAP_QUANTUM = 1e-9  # seconds


@dataclass
class Measured:
    """What one simulated step recorded, before it is priced."""
    numel: int
    labels: list[str]                      # the memory tracker's samples: the label of each
    live: np.ndarray                       # and its live bytes, device then host per category (a row each)
    ledger: list[LedgerEntry]
    events: list[tuple[str, int, float]]   # Ledger.events: (launch or wait, entry index, compute seconds)
    sums: dict[str, float] = field(default_factory=dict)  # flops, compute_s, elsewhere and by-bound seconds


# A Measured as series of (key, values): the key is compared exactly, the values are the numbers one block
# more may change. Memory: each change of the live bytes (label, device then host per category); collectives:
# the launch (with its entry) or the wait, with the compute seconds since the item before rounded to
# GAP_QUANTUM (the sums that make a gap differ in their last bits from one length to the next, ~1e-14 s at a
# 100 s step) and, for a wait, how many launches back its collective was, in the key to align the diff and
# among the values to change (the wait for the first of the reductions backward leaves running is a block's
# launches further back per block); sums: one item. Every key is shift-free: one block more inserts items and
# changes values, nothing else.
Series = dict[str, list[tuple[object, tuple]]]


def series(m: Measured) -> Series:
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


def growth_of(base: Series, longer: Series, align=ALIGNMENTS[0]) -> Optional[dict]:
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


def settled(base: Series, growth: dict, two: Series) -> Optional[dict]:
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


def grown(base: Series, growths: list[tuple[dict, int]]) -> Series:
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


def same(a: Series, b: Series) -> bool:
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


def measured(record: Series) -> Measured:
    """The step a series record describes."""
    labels = [label for (label, _), _ in record["memory"]]
    changes = np.array([change for (_, change), _ in record["memory"]], dtype=np.int64).reshape(
        len(labels), 2 * len(CATEGORIES))
    ledger, events, at = [], [], 0.0
    for (what, *_), (gap, back) in record["comm"]:
        at += gap
        if what[0] == "launch":
            ledger.append(what[1])
            events.append(("launch", len(ledger) - 1, at))
        else:
            events.append(("wait", len(ledger) - back, at))
    (_, names, timed), (numel, *sums) = record["sums"][0]
    return Measured(int(round(numel)), labels, np.cumsum(changes, axis=0), ledger, events if timed else [],
                    dict(zip(names, sums)))


def _sub(a: tuple, b: tuple) -> tuple:
    return tuple(x - y for x, y in zip(a, b))


def _add(a: tuple, b: tuple) -> tuple:
    return tuple(x + y for x, y in zip(a, b))
