"""What the step's compiled graphs hold and do: `CompiledGraphs`, the torch.compile backend zerofunc/whole_step.py
compiles each of its functions with. It runs inductor (or aot_eager, for tests) with the step's collective
pass, which buckets the graph's collectives as the step decides and reads each graph back (its collectives,
and the most gathered bytes alive at any node); and each time a compiled graph runs, it tells the step which
collectives that run issued, so that the ledger holds what the compiled step sent, as the eager step's does."""
from __future__ import annotations

import operator
import types
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from zerofunc.broadcast_gather import BROADCAST_GATHER, BROADCAST_GATHER_INTO
from zerofunc.collectives import GATHER
from zerofunc.decompositions import decompositions

WAIT = torch.ops._c10d_functional.wait_tensor.default
# functionalization's wrappers of a custom op that mutates an input (broadcast_gather_into)
FUNCTIONALIZED = tuple(getattr(torch.ops.higher_order, name) for name in ("auto_functionalized", "auto_functionalized_v2")
                       if hasattr(torch.ops.higher_order, name))
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")  # as the ledger names them (sim/ledger.py)
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}


@dataclass(frozen=True)
class Collective:
    """One collective of a graph: `op` as the ledger names it, and its payload as a ledger entry counts it
    (the whole one: a gather's output, a reduce-scatter's input); `scalar` for a 0-dim payload; `functions`,
    the Python functions its node's stack trace passes through (where the step's code issued it); `overlapped`,
    the matmuls the graph runs while it is in flight, between its issue and its wait (zerofunc/comm_schedule.py)."""

    op: str
    dtype: torch.dtype
    nbytes: int
    scalar: bool
    functions: frozenset = frozenset()
    overlapped: int = 0

    @property
    def gathers(self) -> bool:
        """Whether it is (part of) a gather of weights; else a reduction."""
        return _gathers(self.op, self.functions)


@dataclass
class GraphCollectives:
    """What one compiled graph holds, read after the collective passes: its `phase` ("forward", "backward",
    or "inference" for a graph no backward follows), its collectives in graph order, and the most bytes of
    gathered weights alive at any of its nodes; its matmuls, and (a backward graph's) the bytes of each tensor
    its forward saved for it besides the forward's inputs themselves: the activations, which checkpointing
    trades for the matmuls it runs again."""

    phase: str
    collectives: list[Collective]
    peak_gathered_bytes: int
    matmuls: int = 0
    saved: tuple[tuple[tuple[int, ...], int], ...] = ()  # each saved tensor's shape and bytes

    @property
    def saved_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.saved)


@dataclass(eq=False)
class _Compiled:
    """One graph dynamo handed the backend: what its forward (or inference) graph issues, and its backward's
    (compiled, by AOTAutograd, when backward first reaches it)."""

    forward: Optional[GraphCollectives] = None
    backward: Optional[GraphCollectives] = field(default=None)


def with_own_code(method):
    """`method` (bound) with a code object of its own, to torch.compile. Dynamo keeps what it compiled for a
    function, and the guards that choose it, per code object: every step compiled whole shares WholeStep's
    methods' code, each engine adds its entries, and past dynamo's `recompile_limit` (8) it runs the function
    eagerly, saying so once in a warning (the ninth engine of a process then sent its collectives unrecorded in
    the ledger). With a code object each, an engine's graphs are its own, and go with it."""
    f = method.__func__
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    own.__kwdefaults__ = f.__kwdefaults__
    return types.MethodType(own, method.__self__)


class CompiledGraphs:
    """A torch.compile backend (see the module's docstring). `on_run(phase, collectives)` is told each graph's
    run: a forward or inference graph's as it runs, backward graphs' when the step says its backward has run
    (`backward_ran`), last first. `graphs` keeps every graph read, in the order compiled."""

    def __init__(self, backend: str, bucket_bytes: int, on_run: Callable[[str, list[Collective]], None],
                 schedule: Optional[Callable[[torch.fx.Graph], None]] = None):
        # schedule: moves a graph's collectives in place, after bucketing (zerofunc/comm_schedule.py); None:
        # they stay where traced
        self.backend, self.bucket_bytes, self.on_run, self.schedule = backend, bucket_bytes, on_run, schedule
        self.graphs: list[GraphCollectives] = []
        self._compiling: Optional[_Compiled] = None
        self._awaiting_backward: list[_Compiled] = []  # ran forward since the last backward_ran

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        compiled = self._compiling = _Compiled()
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx
            # the collectives stay where the post-grad pass put them: inductor's comm reordering would hoist
            # every gather; its peak-memory reordering puts each wait back right after its collective
            run = compile_fx(gm, example_inputs, decompositions=decompositions(), config_patches={
                "post_grad_custom_post_pass": self._post_grad, "reorder_for_compute_comm_overlap": False,
                **({"reorder_for_peak_memory": False} if self.schedule is not None else {})})
        else:  # traced and partitioned as under inductor (its partitioner recomputes what the policy says), run
            # without codegen: the collectives read, not bucketed
            from torch._dynamo.backends.common import aot_autograd
            from torch._functorch.aot_autograd import make_boxed_func
            from torch._functorch.partitioners import min_cut_rematerialization_partition

            def read(g, _inputs):
                self._schedule(g.graph)
                g.recompile()
                self._read(g.graph)
                return make_boxed_func(g.forward)
            run = aot_autograd(fw_compiler=read, bw_compiler=read, inference_compiler=read,
                               partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)

        def ran(*args):
            out = run(*args)
            if compiled.forward is not None:
                if compiled.forward.phase == "forward":
                    self._awaiting_backward.append(compiled)
                self.on_run(compiled.forward.phase, compiled.forward.collectives)
            return out
        return ran

    def backward_ran(self) -> None:
        """The backward of every forward run since the last call has run: tell `on_run` its collectives."""
        for compiled in reversed(self._awaiting_backward):
            if compiled.backward is not None:
                self.on_run("backward", compiled.backward.collectives)
        self._awaiting_backward.clear()

    def _post_grad(self, graph: torch.fx.Graph) -> None:
        """Inductor's post-grad pass: buckets gathers and reduce-scatters up to `bucket_bytes` (adjacent ones
        only, so every rank issues the same), moves the collectives to overlap (`schedule`), then reads the
        graph. A plain callable, not a CustomGraphPass: inductor then bypasses its graph caches for these
        graphs, so the pass runs, and reads the graphs, on every compile (a cached graph would come back
        unread)."""
        from torch._inductor.fx_passes import bucketing
        cap_mb = lambda _bucket: self.bucket_bytes / 2**20  # noqa: E731
        if self.bucket_bytes:
            bucketing.bucket_all_gather(graph.owning_module, cap_mb)
            if hasattr(bucketing, "bucket_reduce_scatter"):  # not in every torch this runs on
                bucketing.bucket_reduce_scatter(graph.owning_module, cap_mb)
        self._schedule(graph)
        self._read(graph)

    def _schedule(self, graph: torch.fx.Graph) -> None:
        if self.schedule is not None:
            self.schedule(graph)

    def _read(self, graph: torch.fx.Graph) -> None:
        read = read_collectives(graph)
        self.graphs.append(read)
        if read.phase != "backward":
            self._compiling.forward = read
        else:  # compiled as backward first reaches it: the latest forward that ran without its backward's graph
            waiting = [c for c in self._awaiting_backward if c.backward is None] or [self._compiling]
            waiting[-1].backward = read


def graph_phase(graph: torch.fx.Graph) -> str:
    """Which of AOTAutograd's graphs `graph` is, by the names it gives the inputs: primals_N (a forward that
    a backward follows), tangents_N (that backward), argN_1 (an inference graph)."""
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    if any(n.startswith("tangents") for n in names):
        return "backward"
    return "forward" if any(n.startswith("primals") for n in names) else "inference"


def read_collectives(graph: torch.fx.Graph) -> GraphCollectives:
    """The collectives of `graph`, and the most bytes of gathered weights alive at once (an all-gather's
    output, or a gather issued as broadcasts or as an all-reduce): each output lives from its gather to the
    last use of anything that aliases it (its wait, views, slices, a bucket's split; for a bucket gathered
    into a buffer, `out=`, that buffer's uses too)."""
    nodes = list(graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    collectives, spans = [], []
    for n in nodes:
        op = _ledger_op(n)
        if op is None:
            continue
        payload = n.args[0].meta.get("val") if op == "reduce_scatter" else n.meta.get("val")  # the whole payload
        tensors = [t for t in (payload if isinstance(payload, (list, tuple)) else [payload])
                   if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        waits = [where[u] for u in completing(n) if u.target is WAIT]
        overlapped = sum(1 for m in nodes[where[n]:min(waits, default=where[n])] if m.target in MATMULS)
        ranks = _broadcasts(n)
        functions = _functions(n)
        collectives += [Collective(op, tensors[0].dtype, nbytes // ranks, all(t.dim() == 0 for t in tensors),
                                   functions, overlapped)] * ranks
        if _gathers(op, functions):
            heads = [n] + [a for a in [n.kwargs.get("out")] if isinstance(a, torch.fx.Node)]
            spans.append((where[n], max(_last_alias_use(h, where) for h in heads), nbytes))
    peak = max((sum(b for lo, hi, b in spans if lo <= i <= hi) for i in range(len(nodes))), default=0)
    phase = graph_phase(graph)
    saved = [n.meta.get("val") for n in nodes if phase == "backward" and n.op == "placeholder"
             and not n.name.startswith(("primals", "tangents"))]  # AOTAutograd's names for the inputs
    return GraphCollectives(phase, collectives, peak, sum(1 for n in nodes if n.target in MATMULS),
                            tuple((tuple(map(int, t.shape)), int(t.numel()) * t.element_size()) for t in saved
                                  if isinstance(t, torch.Tensor)))


def _called(n: torch.fx.Node):
    """The op `n` calls: its target, or the mutating custom op that functionalization's wrapper calls."""
    return n.args[0] if n.op == "call_function" and n.target in FUNCTIONALIZED else n.target


def _broadcasts(n: torch.fx.Node) -> int:
    """How many collectives the gather `n` issues: one broadcast per rank of its group for zerofunc's ops
    (zerofunc/broadcast_gather.py), as the eager step issues them; else 1."""
    op = _called(n)
    if op is BROADCAST_GATHER:
        return n.args[1]
    if op is BROADCAST_GATHER_INTO:  # mutating, so functionalized in every graph: its arguments by name
        return n.kwargs["world"]
    return 1


def completing(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that complete the collective `n`: its waits; for a functionalized op, the results it is read
    through (getitem) and their waits."""
    results = [u for u in n.users if u.target is operator.getitem] if n.target in FUNCTIONALIZED else []
    return results + [u for m in [n, *results] for u in m.users if u.target is WAIT]


def _ledger_op(n: torch.fx.Node) -> Optional[str]:
    """The ledger's name for the collective `n` issues; None where `n` issues none (a wait is no collective)."""
    if n.op == "call_function" and _called(n) in (BROADCAST_GATHER, BROADCAST_GATHER_INTO):  # one broadcast per rank
        return "broadcast"
    name = getattr(n.target, "__name__", str(n.target))
    if n.op != "call_function" or "_c10d_functional" not in str(n.target) or "wait" in name:
        return None
    op = next((o for o in OPS if name.startswith(o)), None)
    if op is None:
        raise ValueError(f"the compiled step issues {name}, which the ledger has no name for")
    return op


def _functions(n: torch.fx.Node) -> frozenset:
    """The Python functions `n`'s stack trace passes through: where the step's code issued it."""
    trace = n.meta.get("stack_trace") or ""
    return frozenset(line.rsplit(" in ", 1)[1].strip() for line in trace.splitlines()
                     if line.lstrip().startswith("File ") and " in " in line)


def is_collective(n: torch.fx.Node) -> bool:
    """Whether `n` issues a collective (a wait issues none)."""
    return _ledger_op(n) is not None


def is_gather(n: torch.fx.Node) -> bool:
    """Whether `n` issues (part of) a gather of weights: an all-gather, one of its broadcasts, or the
    all-reduce that stands in for a small one (zerofunc/collectives.py, `gathered`)."""
    op = _ledger_op(n)
    return op is not None and _gathers(op, _functions(n))


def _gathers(op: str, functions: frozenset) -> bool:
    """A collective `op` issued through `functions` gathers weights: an all-gather, a broadcast, or the
    all-reduce that stands in for a small all-gather (zerofunc/collectives.py, `gathered`)."""
    return op in ("all_gather", "broadcast") or (op == "all_reduce" and GATHER in functions)


def is_reduction(n: torch.fx.Node) -> bool:
    """Whether `n` issues a reduction of a tensor that is no gather's: a gradient's reduce-scatter, or the
    all-reduce that stands in for it or sums it whole."""
    if _ledger_op(n) is None or is_gather(n):
        return False
    val = n.meta.get("val")
    return not (isinstance(val, torch.Tensor) and val.dim() == 0)


def _last_alias_use(node: torch.fx.Node, where: dict) -> int:
    last, stack, seen = where[node], [node], {node}
    while stack:
        for user in stack.pop().users:
            last = max(last, where[user])
            name = str(user.target)
            aliases = user.target is WAIT or any(k in name for k in ("getitem", "view", "split", "slice",
                                                                        "as_strided", "reinterpret", "alias"))
            if aliases and user not in seen:
                seen.add(user)
                stack.append(user)
    return last
