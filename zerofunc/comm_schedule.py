"""Where a compiled graph's collectives complete: stage 3's prefetch, and stages 2-3's reduce-scatters, made
to overlap the compute around them.

Dynamo traces a functional collective's wait where the collective is issued, and the concatenation of a
gather's slots (gloo's broadcasts) right after it; the step issues each block's gather where the model's
forward runs the block (so the gathers come in the order the forward runs its blocks, whatever the module's
code picks), and so it finishes before that block computes; in backward each block's gather is recomputed
just before its own backward; and each gradient's reduce-scatter is waited for before the next block's
backward starts. Nothing overlaps. Inductor's comm-reordering passes would move
them, but without a bound: they hoist every gather to the graph's start (zerofunc/whole_step.py keeps them
off), and sinking a reduce-scatter's wait to its first use (the graph's output) keeps every block's whole
gradient alive to the end. This pass moves them within ZeRO's bounds:

1. each gather's completion (its waits, the concatenation, the views of the whole weights) sinks to just
   before the first node that reads the weights;
2. each gather is issued no later than just before the completion of the gather `gather_depth` places ahead
   of it, so that that many are in flight while a block computes: the eager step's prefetch depth;
3. each reduction is issued as soon as the matmuls of its gradient are done (AOTAutograd may leave a
   gradient's cheap sums and concatenation until after the next block's matmuls), and
4. completes just before the next reduction is issued: one block's gradient in flight while the block
   before it computes its backward, as the eager step overlaps them;
5. in the update's graph (stages 1-2), where each unit's new weights are gathered as its AdamW ends, each
   gather completes just before the next is issued: one unit's gather in flight while the next unit's
   AdamW computes, where dynamo traced each waited for at once; and its write into the weights (the graph's
   input, which functionalization writes at the graph's end) follows its completion at once, so that no
   unit's gathered copy is kept to the end, which would hold the whole model twice (on gloo the gather
   writes the weights themselves, and inductor drops that write: zerofunc/broadcast_gather.py).

So the bytes gathered at once stay what the eager step holds (the root unit, the computing block and
`gather_depth` prefetched), which tests/test_whole_step.py reads back from the graphs; the values are
untouched (nodes move, none changes), which its equivalence test holds. Every rank moves its nodes alike:
gloo pairs collectives by the order they are issued in."""
from __future__ import annotations

from typing import Callable

import torch

from zerofunc.compiled_graphs import MATMULS, WAIT, completing, is_collective, is_gather, is_reduction


def _groups(graph: torch.fx.Graph, which: Callable[[torch.fx.Node], bool]) -> list[tuple[list, list]]:
    """The graph's collectives that `which` picks, in order, each as (its collectives, its completion: the
    nodes computed from their waits alone), both in graph order. A gather issued as several collectives (one
    broadcast per rank) is one.
    Keyed by position, never by anything that differs between processes (an id): every rank moves alike."""
    nodes = list(graph.nodes)
    owner: dict[torch.fx.Node, int] = {}  # a collective or completion node: the position of its gather's first
    for i, n in enumerate(nodes):
        if is_collective(n) and which(n):
            owner[n] = i
            for w in completing(n):
                owner[w] = i
            continue
        ins = n.all_input_nodes
        if n.op != "call_function" or not ins or not all(a in owner and not is_collective(a) for a in ins):
            continue
        first, *others = sorted({owner[a] for a in ins})
        for m, o in owner.items():  # one completion of several collectives: one gather
            if o in others:
                owner[m] = first
        owner[n] = first
    gathers: dict[int, tuple[list, list]] = {}
    for n in nodes:
        if n in owner:
            gathers.setdefault(owner[n], ([], []))[0 if is_collective(n) else 1].append(n)
    return [gathers[k] for k in sorted(gathers)]


def _ancestors_after(node: torch.fx.Node, where: dict, at: int) -> list[torch.fx.Node]:
    """`node` and the nodes it is computed from that come after position `at`, in graph order."""
    seen, stack = {node}, [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen and a.op == "call_function" and where[a] > at:
                seen.add(a)
                stack.append(a)
    return sorted(seen, key=where.__getitem__)


def _positions(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _complete_before(completion: list, limit: torch.fx.Node | None, graph: torch.fx.Graph) -> None:
    """Move a collective's completion to just before the first node that reads it, or before `limit` if
    that comes first; not above a node it reads (a block run more than once reduces its gradient at each
    run, and the runs' reductions complete as one: `limit`, the next reduction, may be one of them)."""
    inside = set(completion)
    where = _positions(graph)
    stops = [u for c in completion for u in c.users if u not in inside] + ([limit] if limit is not None else [])
    read = [where[a] for c in completion for a in c.all_input_nodes if a not in inside]
    if stops:
        first = min(stops, key=where.__getitem__)
        if where[first] > max([where[completion[0]], *read]):
            for c in completion:
                first.prepend(c)


def overlap(graph: torch.fx.Graph, gather_depth: int | None, reductions: bool, gathers_in_turn: bool = False) -> None:
    """Move `graph`'s gathers (1-2, when `gather_depth` is given; 5, when `gathers_in_turn`) and reductions (3-4,
    when `reductions`) as the module's docstring says, in place."""
    if gather_depth is not None:
        gathers = _groups(graph, is_gather)
        for _, completion in gathers:  # 1. complete each just before its weights are read
            if completion:
                _complete_before(completion, None, graph)
        for k in range(gather_depth, len(gathers)):  # 2. issue each before the completion `depth` ahead of it
            completion = gathers[k - gather_depth][1]
            if not completion:
                continue
            for collective in gathers[k][0]:
                where = _positions(graph)
                if where[collective] > where[completion[0]]:
                    for n in _ancestors_after(collective, where, where[completion[0]]):
                        completion[0].prepend(n)
    if reductions:
        reduced = _groups(graph, is_reduction)
        for issued, _ in reduced:  # 3. each reduction issued as soon as the matmuls it reduces are done
            for collective in issued:
                _issue_after_matmuls(collective, graph)
        _in_turn(reduced, graph)  # 4. completed before the next is issued
    if gathers_in_turn:  # 5.
        gathers = _groups(graph, is_gather)
        _in_turn(gathers, graph)
        for _, completion in gathers:
            _written_back_at_once(completion, graph)


def _in_turn(collectives: list[tuple[list, list]], graph: torch.fx.Graph) -> None:
    """Each of `collectives` (from `_groups`) completes just before the next is issued, or before its first
    reader if that comes first."""
    for (_, completion), (issued, _) in zip(collectives, collectives[1:]):
        if completion:
            _complete_before(completion, issued[0], graph)


def _issue_after_matmuls(collective: torch.fx.Node, graph: torch.fx.Graph) -> None:
    """Move `collective`, and the cheap nodes between it and the last matmul it depends on (a gradient's
    sums and concatenation, which AOTAutograd may order after the next block's matmuls), to just after that
    matmul."""
    where = _positions(graph)
    tail, stops, stack = {collective}, [], [collective]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a in tail:
                continue
            if a.op != "call_function" or a.target in MATMULS or is_collective(a) or a.target is WAIT \
                    or _mutates(a):  # an in-place op moved ahead of a reader of what it writes would change it
                stops.append(a)
            else:
                tail.add(a)
                stack.append(a)
    if not stops:
        return
    last = max(stops, key=where.__getitem__)
    for n in sorted((n for n in tail if where[n] > where[last]), key=where.__getitem__, reverse=True):
        last.append(n)


def _mutates(n: torch.fx.Node) -> bool:
    """Whether `n` writes into one of its inputs (an aten op's schema says; a Python function such as
    getitem writes nothing)."""
    schema = getattr(n.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _written_back_at_once(completion: list, graph: torch.fx.Graph) -> None:
    """Move each write of `completion` into a graph input (`copy_`, functionalization's write-back of a mutated
    input) to just after the completion's last node, unless a node before that place reads that input after it.
    Not after the node it copies: a gather into the weights is read through a getitem ahead of its wait, and
    written back from there it would copy slots still being received."""
    for c in completion:
        for write in [u for u in c.users if u.target is torch.ops.aten.copy_.default and u.args[1] is c]:
            dest = write.args[0]
            where = _positions(graph)
            done = max(completion, key=where.__getitem__)
            if dest.op != "placeholder" or where[write] < where[done]:
                continue
            if all(where[r] < where[done] for r in dest.users if r is not write):
                done.append(write)
