"""The forward cut into segments, and backward as an explicit loop over them in reverse.

A ZeRO step wants each unit's gradient the moment backward is done with the unit, as a value it
can reduce, and it wants to know, between two units, that now is the time to gather the next
one. One autograd graph over the whole forward gives neither: `loss.backward()` runs every node
in an order autograd picks. So the forward is cut into segments, one per block and one per stretch
of code between blocks (the first segment: the code before the first block, e.g. the embeddings;
the last: what follows the last block, e.g. a head), and backward differentiates one segment at a time, the last first:

    tape = Tape()
    with tape:                                   # the model's own forward, any nn.Module
        ... tape.open(unit) on entering each block, tape.open(None) on leaving it ...
    tape.seed(loss, grad)
    for segment in reversed(tape.segments):
        grads = tape.grad(segment, weights)      # this segment's weights' gradients, as values

Each segment's graph is closed: a tensor that requires grad and was made in an earlier segment
enters a later one through a leaf of its own (a detached alias, sharing its storage), whatever
the model's code does with it: passes it to the next block (the hidden state), keeps it across
blocks (a residual stream, a mask, position embeddings), or reads it in the head. The tape sees
every torch operation of the forward (it is a `TorchFunctionMode`), tags each result with the
segment that made it, and swaps an older segment's tensor for its leaf as the operation takes
it. In backward, a segment's outputs are the tensors of it that later segments took, with the
gradients their leaves received; `torch.autograd.grad` over them gives the gradients of the
segment's own leaves (handed on to the segments that made their tensors) and of the weights
asked for. Nothing is computed twice and nothing is saved that one graph would not save: the
leaves share their tensors' storage, and the graph of each segment is freed as it is
differentiated. In fp32 the gradients are those of `loss.backward()`, the same terms summed: bit for
bit where autograd adds them in the same order (tests/test_tape.py), which it need not where a
segment's outputs' gradients meet again inside it (a block's output read by the next block and by an
auxiliary loss: one fp32 ulp apart, in a probe).

Weights are not tagged: a unit's buffer (and the views the model computes with) is a leaf the
step makes, and `grad` returns its gradient from the segments that used it; a weight used in
several segments (the root unit's: embeddings, a tied head) gets one gradient from each.

Calls no mode sees (a custom autograd Function's `apply`, code run with torch functions disabled)
make tensors the tape did not tag. When a seen operation takes one, the tape walks its graph back
to tagged nodes: made from one segment's tensors, it belongs to that segment; made from two
segments' tensors, its node would join their graphs, and the tape refuses it in one line.
`overridable` makes a function seen; zerofunc's own Functions go through it.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import (TorchFunctionMode, _get_current_function_mode, _pop_mode_temporarily, handle_torch_function,
                             has_torch_function)
from torch.utils._pytree import tree_leaves, tree_map_only


# Tensor properties and methods that only read metadata (pack hooks, shape logic call them on every
# tensor): the tape passes them straight through
_METADATA = frozenset(
    [getattr(torch.Tensor, p).__get__ for p in ("grad_fn", "requires_grad", "_base", "is_leaf", "shape", "dtype",
                                                "device", "ndim", "layout", "is_cuda", "is_meta", "data")]
    + [getattr(torch.Tensor, m) for m in ("size", "dim", "stride", "numel", "data_ptr", "untyped_storage",
                                          "element_size", "is_contiguous", "storage_offset", "is_floating_point",
                                          "__len__")])
_PARAMETER = torch.nn.Parameter  # a module's own weight, which the step never computes with (see Tape.__init__)
_NODE_TAG = "zerofunc_segment"  # in an autograd node's metadata: the (tape, segment) that made it


def overridable(fn):
    """`fn`, seen by torch function modes as torch's own functions are. Wrap a function that calls a
    custom autograd Function's `apply` (which no mode sees) with it, so that the tape sees its inputs."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if has_torch_function(args):
            return handle_torch_function(wrapper, args, *args, **kwargs)
        return fn(*args, **kwargs)
    return wrapper


class Import(NamedTuple):
    """An older segment's tensor as a later one took it: `leaf`, the alias the later segment computed
    with, and where its gradient goes: `edge`, the tensor's place in the autograd graph of the segment
    `made` that made it. An edge, not the tensor: a view's graph can no longer be reached through the
    tensor once its base has been written in place (a released and regathered stage-3 weight)."""

    leaf: torch.Tensor
    edge: GradientEdge
    made: int


@dataclass(eq=False)
class Segment:
    """One segment of a forward: `index` in the tape, the `unit` (a name) whose block opened it (None
    for code between blocks), and what it took from older segments."""

    index: int
    unit: Optional[str]
    imports: list[Import] = field(default_factory=list)
    _taken: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)  # id -> (t, leaf)


class Tape(TorchFunctionMode):
    """Records one forward as segments (see the module's docstring); differentiates them one at a time."""

    _ids = itertools.count()
    # Differentiate on autograd's device worker thread (torch's default for CUDA graphs) instead of the
    # calling thread (see `grad`): for benchmarks/step_overhead.py, which times the step both ways.
    worker_thread = False

    def __init__(self, on_plain_backward: Optional[Callable[[torch.Tensor], None]] = None,
                 on_module_parameter: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """`on_plain_backward(leaf)`: called should a plain `.backward()` reach a leaf of the tape's (it is
        differentiated with `grad`, a segment at a time); `on_module_parameter(p)`: should an operation take
        an `nn.Parameter` (the step computes with views of its buffers, never the module's own). Both may raise."""
        super().__init__()
        self._on_plain_backward, self._on_module_parameter = on_plain_backward, on_module_parameter
        self._differentiating = False
        self._id = next(Tape._ids)  # what tensors are tagged with: not the tape, which they would keep alive
        self.segments: list[Segment] = [Segment(0, None)]
        self._leaf_import: dict[int, Import] = {}  # id(leaf) -> its import, for a leaf an even later segment takes
        self._pending: dict[tuple[int, int], tuple[GradientEdge, int, torch.Tensor]] = {}  # edge -> (edge, made, grad)

    # ---- forward ---------------------------------------------------------------------------------------
    def open(self, unit: Optional[str]) -> Segment:
        """A block starts (`unit`, its name) or ends (None): the operations from here to the next `open`
        form a new segment."""
        self.current._taken.clear()  # its tensors may go: a later segment takes them anew
        self.segments.append(Segment(len(self.segments), unit))
        return self.segments[-1]

    @property
    def current(self) -> Segment:
        return self.segments[-1]

    def _take(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the current segment takes it: its own leaf, if an earlier segment made it and it
        requires grad; else itself."""
        if not t.requires_grad:
            return t
        made = self._made(t)
        if made is None or made == len(self.segments) - 1:
            return t
        seg = self.current
        taken = seg._taken.get(id(t))  # held with `t`: its id names it while the segment runs
        if taken is not None:
            return taken[1]
        leaf = t.detach().requires_grad_()
        leaf._zerofunc_segment = (self._id, seg.index)
        if self._on_plain_backward is not None:
            leaf.register_post_accumulate_grad_hook(self._on_plain_backward)
        older = self._leaf_import.get(id(t))  # an older segment's leaf: its gradient goes where that one's goes
        imported = Import(leaf, *(older[1:] if older is not None else (get_gradient_edge(t), made)))
        seg.imports.append(imported)
        self._leaf_import[id(leaf)] = imported
        seg._taken[id(t)] = (t, leaf)
        return leaf

    def _made(self, t: torch.Tensor) -> Optional[int]:
        """The segment that made `t`: its autograd node's tag; for a leaf, the segment it is a leaf of
        (None for a weight or a leaf of the caller's: differentiated wherever it is used)."""
        if t.grad_fn is None:
            tag = getattr(t, "_zerofunc_segment", None)
        else:
            tag = t.grad_fn.metadata.get(_NODE_TAG)
            if tag is None:
                return self._made_unseen(t.grad_fn)
        return tag[1] if tag is not None and tag[0] == self._id else None

    def _made_unseen(self, node) -> Optional[int]:
        """The segment of a node made by calls the tape did not see: a custom autograd Function's
        `apply` (no mode sees it; `overridable` makes one seen), code run with torch functions
        disabled, views of the weights the engine made before the forward. It belongs to the segment
        its inputs' nodes belong to, found by walking back through unseen nodes to seen ones; with
        none behind it (a weight's view) to none: like the weight, it is differentiated wherever it is
        used. Inputs from two segments would join two segments' graphs, which is refused."""
        segments = self._segments_behind(node, {})
        if len(segments) > 1:
            raise ValueError(f"{type(node).__name__} (a call the tape does not see, such as a custom autograd "
                             "Function's apply) took tensors made between different blocks: call it through "
                             "zerofunc.tape.overridable")
        made = segments.pop() if segments else None
        node.metadata[_NODE_TAG] = (self._id, made)
        return made

    def _segments_behind(self, node, seen: dict) -> set[int]:
        tag = node.metadata.get(_NODE_TAG)
        if tag is None and not node.next_functions:  # a leaf's AccumulateGrad: a segment's leaf, or a weight
            tag = getattr(getattr(node, "variable", None), "_zerofunc_segment", None)
        if tag is not None:
            return {tag[1]} if tag[0] == self._id and tag[1] is not None else set()
        if id(node) not in seen:
            seen[id(node)] = set()
            for nxt, _ in node.next_functions:
                if nxt is not None:
                    seen[id(node)] |= self._segments_behind(nxt, seen)
        return seen[id(node)]

    def _tag(self, t: torch.Tensor) -> None:
        """A result's autograd node belongs to the current segment (an op returning its input in place
        leaves the input's node, once tagged, as it is)."""
        if t.grad_fn is not None and _NODE_TAG not in t.grad_fn.metadata:
            t.grad_fn.metadata[_NODE_TAG] = (self._id, len(self.segments) - 1)

    def __torch_function__(self, func, types, args: Sequence[Any] = (), kwargs=None):
        # metadata reads compute nothing (no leaf, no tag); once backward has begun, the tape records no
        # more (a checkpointed block's recomputation re-enters the forward's modes, this one included)
        if func in _METADATA or self._differentiating:
            return func(*args, **(kwargs or {}))
        # Every torch operation of the forward passes here: arguments are walked by hand one level deep
        # (a tensor, or a list of them, as torch.cat takes), the pytree only for deeper nesting.
        args = tuple(self._take_arg(a) for a in args)
        if kwargs:
            kwargs = {k: self._take_arg(v) for k, v in kwargs.items()}
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            if out.requires_grad:
                self._tag(out)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    if o.requires_grad:
                        self._tag(o)
                elif isinstance(o, (tuple, list, dict)):
                    tree_map_only(torch.Tensor, self._tag, o)
        return out

    def _take_arg(self, a):
        if isinstance(a, torch.Tensor):
            if type(a) is _PARAMETER and self._on_module_parameter is not None:
                self._on_module_parameter(a)
            return self._take(a) if a.requires_grad else a
        if isinstance(a, (tuple, list)) and a:
            if not any(isinstance(x, (torch.Tensor, tuple, list, dict)) for x in a):
                return a  # a shape, a dim list: most sequences an operation takes hold no tensor
            if all(isinstance(x, torch.Tensor) for x in a):
                return type(a)(self._take(x) if x.requires_grad else x for x in a)
            return tree_map_only(torch.Tensor, self._take, a)
        if isinstance(a, dict):
            return tree_map_only(torch.Tensor, self._take, a)
        return a

    @contextlib.contextmanager
    def paused(self):
        """Work inside the forward that is not the model's (the engine gathering a block, binding views
        of its weights): not watched, and what it makes is tagged with no segment, as a weight is."""
        if _get_current_function_mode() is not self:
            yield
            return
        with _pop_mode_temporarily():
            yield

    def unseen(self, fn, args: tuple = (), kwargs: Optional[dict] = None, check_reads: bool = True):
        """`fn(*args, **kwargs)` as one operation of the current segment, whose inside the tape does not
        watch: a block (the engine runs every block so: watching costs Python on each torch call, and
        dynamo does not trace a mode's bookkeeping). Its tensor arguments are taken, and its results
        tagged, as any operation's: with the tape off, as in its handler, since the taking and tagging
        are torch operations too. Since the inside is not watched, a tensor of an earlier segment that
        `fn` reads other than through its arguments (a closure, a module attribute) would join the two
        segments' graphs: with `check_reads`, the results' graph is walked back, and such a read refused
        (a walk costs about as much Python as watching: the engine checks a block's first forward only)."""
        with self.paused():
            args = tuple(self._take_arg(a) for a in args)
            kwargs = {k: self._take_arg(v) for k, v in (kwargs or {}).items()}
            out = fn(*args, **kwargs)
            here, seen = len(self.segments) - 1, {}
            for t in (out,) if isinstance(out, torch.Tensor) else tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                    if check_reads and self._segments_behind(t.grad_fn, seen) - {here}:
                        raise ValueError(f"{getattr(fn, '__qualname__', fn)} read a tensor made before it other "
                                         "than through its arguments (a closure or a module attribute): pass it "
                                         "as an argument")
                    self._tag(t)
        return out

    # ---- backward --------------------------------------------------------------------------------------
    def seed(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward starts from `output` (the loss) with gradient `grad` (the loss scale). A loss
        computed from the weights alone belongs to no segment, and is differentiated in the last."""
        tag = output.grad_fn.metadata.get(_NODE_TAG) if output.grad_fn is not None else None
        if output.grad_fn is None or (tag is not None and tag[0] != self._id):
            raise ValueError("the loss was not computed inside this tape's forward")
        made = self._made(output)
        self._hand_on(get_gradient_edge(output), len(self.segments) - 1 if made is None else made, grad)
        self._differentiating = True

    def _hand_on(self, edge: GradientEdge, made: int, g: torch.Tensor) -> None:
        key = (id(edge.node), edge.output_nr)
        held = self._pending.get(key)
        self._pending[key] = (edge, made, g if held is None else held[2] + g)

    def grad(self, segment: Segment, weights: Sequence[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """Differentiate `segment`: hand its leaves' gradients to the segments that made their tensors,
        and return the gradients of `weights` through this segment (None where it did not use one).
        Segments are differentiated last first, each once."""
        segment._taken.clear()
        outputs, grads = [], []
        for key, (edge, made, g) in list(self._pending.items()):
            if made == segment.index:
                outputs.append(edge)
                grads.append(g)
                del self._pending[key]
        imports, segment.imports = segment.imports, []
        if not outputs:
            return [None] * len(weights)
        # On the calling thread: by default autograd hands a CUDA graph to the device's worker thread and
        # waits for it, a round trip per call, and this is one call a segment, not one a step (on a GPU,
        # a launch-bound step was 0.64x the one-graph engine's: docs/CUDA.md, fifth run). On a CPU
        # graph it runs on the calling thread either way.
        with torch.autograd.set_multithreading_enabled(self.worker_thread):
            got = torch.autograd.grad(outputs, [i.leaf for i in imports] + list(weights), grads, allow_unused=True)
        for i, g in zip(imports, got):
            if g is not None:
                self._hand_on(i.edge, i.made, g)
        if segment.index == 0 and self._pending:
            raise RuntimeError(f"{len(self._pending)} gradients were handed to no segment")
        return list(got[len(imports):])
