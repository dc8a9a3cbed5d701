"""zerofunc/comm_schedule.py on a graph built by hand: what it may move and what it must not.

The compiled step's tests (tests/test_whole_step.py) run the pass on the graphs inductor hands it; those hold
no in-place op in a gradient's tail, which a model's graph may (inductor's reinplacing turns an index_put
into index_put_). Moving such an op ahead of a node that reads what it writes would change that node's value."""
from __future__ import annotations

import torch
import torch.fx

from zerofunc.comm_schedule import overlap

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _graph_with_an_in_place_tail():
    """x @ w is all-reduced; then a buffer is read (`reader`), written in place with the product (`write`),
    and the written buffer all-reduced. The second reduction's tail (`write`, `total`) follows its matmul
    only after `reader`."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    product = g.call_function(aten.mm.default, (x, w))
    first = g.call_function(c10d.all_reduce.default, (product, "sum", "0"))
    first_done = g.call_function(c10d.wait_tensor.default, (first,))
    buffer = g.call_function(aten.zeros.default, ([2, 2],))
    reader = g.call_function(aten.add.Tensor, (buffer, 1.0))
    write = g.call_function(aten.add_.Tensor, (buffer, product))
    total = g.call_function(aten.mul.Tensor, (write, 2.0))
    second = g.call_function(c10d.all_reduce.default, (total, "sum", "0"))
    second_done = g.call_function(c10d.wait_tensor.default, (second,))
    g.output((first_done, second_done, reader))
    return g, reader, write, second


def test_a_reduction_is_not_issued_ahead_of_an_in_place_write_s_readers():
    """The second all-reduce moves up to its matmul with its tail, but not past the in-place write, which
    stays after the node reading the buffer before it (tests/plants.py: comm_schedule_moves_in_place_ops);
    the graph stays well formed."""
    g, reader, write, second = _graph_with_an_in_place_tail()
    overlap(g, gather_depth=None, reductions=True)
    g.lint()
    order = list(g.nodes)
    assert order.index(reader) < order.index(write) < order.index(second), [n.name for n in order]


def test_the_first_reduction_completes_before_the_second_is_issued():
    """Two reductions: the first's wait sinks past the compute between them, to just before the second is
    issued (one in flight at a time), and not further (tests/plants.py: whole_step_reductions_waited_at_once
    is the same move on inductor's graphs)."""
    g, reader, write, second = _graph_with_an_in_place_tail()
    overlap(g, gather_depth=None, reductions=True)
    order = list(g.nodes)
    first_done = next(n for n in order if n.target is c10d.wait_tensor.default)
    assert order.index(first_done) == order.index(second) - 1, [n.name for n in order]
