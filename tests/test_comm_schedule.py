"""zerofunc/comm_schedule.py on a graph built by hand: what it may move and what it must not.

The compiled step's tests (tests/test_whole_step.py) run the pass on the graphs inductor hands it; those hold
no in-place op in a gradient's tail, which a model's graph may (inductor's reinplacing turns an index_put
into index_put_). Moving such an op ahead of a node that reads what it writes would change that node's value."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

from zerofunc.broadcast_gather import BROADCAST_GATHER_INTO
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


def test_a_reduction_is_issued_as_soon_as_its_matmul_is_done():
    """A gradient's cheap tail (a sum, a concatenation) and its reduction left by AOTAutograd after the next block's
    matmul: both move up to just after the gradient's own matmul, so that the reduction overlaps the next one
    (tests/plants.py: whole_step_reductions_issued_late; on the compiled step's own graphs, tests/test_whole_step.py
    holds it at stages 0-2)."""
    g = torch.fx.Graph()
    x, w, v = g.placeholder("x"), g.placeholder("w"), g.placeholder("v")
    grad = g.call_function(aten.mm.default, (x, w))
    following = g.call_function(aten.mm.default, (x, v))  # the next block's backward
    tail = g.call_function(aten.mul.Tensor, (grad, 2.0))
    reduce = g.call_function(c10d.reduce_scatter_tensor.default, (tail, "sum", 2, "0"))
    done = g.call_function(c10d.wait_tensor.default, (reduce,))
    g.output((done, following))
    overlap(g, gather_depth=None, reductions=True)
    g.lint()
    order = list(g.nodes)
    assert order.index(grad) < order.index(tail) < order.index(reduce) < order.index(following), \
        [n.name for n in order]


def test_a_gather_waited_for_where_it_is_issued_completes_where_its_weights_are_read():
    """A block's gather issued, and (as dynamo traces it) waited for, ahead of the block before it: its wait sinks
    to just before its weights are read, past the block before it, whose compute it then overlaps (tests/plants.py:
    whole_step_gathers_waited_at_once). The step traces each gather where its block runs, next to its readers,
    so in its graphs the move finds nothing to do (tests/test_whole_step.py); it holds should one be traced ahead."""
    g = torch.fx.Graph()
    x, shard0, shard1 = g.placeholder("x"), g.placeholder("shard0"), g.placeholder("shard1")
    first = g.call_function(c10d.all_gather_into_tensor.default, (shard0, 2, "0"))
    first_done = g.call_function(c10d.wait_tensor.default, (first,))
    second = g.call_function(c10d.all_gather_into_tensor.default, (shard1, 2, "0"))
    second_done = g.call_function(c10d.wait_tensor.default, (second,))
    h = g.call_function(aten.mm.default, (x, first_done))  # the first block
    out = g.call_function(aten.mm.default, (h, second_done))  # the second
    g.output((out,))
    overlap(g, gather_depth=1, reductions=False)
    g.lint()
    order = list(g.nodes)
    assert order.index(second) < order.index(h) < order.index(second_done) < order.index(out), \
        [n.name for n in order]


def _update_graph(read_old_weights_late: bool = False, into_weights: bool = False):
    """The update's graph at stages 1-2 as dynamo traces it, two units: each unit's AdamW (`new`), the gather
    of the new weights (a broadcast, waited for at once, the ranks' slots concatenated; `into_weights`: on gloo,
    zerofunc's op that broadcasts into the weights, functionalized, read through a getitem), and, at the graph's
    end, functionalization's write-back of the weights. With `read_old_weights_late`, a node before the
    write-backs reads unit 0's old weights."""
    g = torch.fx.Graph()
    weights, moments = [g.placeholder(f"w{k}") for k in range(2)], [g.placeholder(f"m{k}") for k in range(2)]
    nodes = {}
    for k in range(2):
        nodes[f"new{k}"] = new = g.call_function(aten.mul.Tensor, (moments[k], 2.0))
        if into_weights:
            nodes[f"issue{k}"] = issue = g.call_function(torch.ops.higher_order.auto_functionalized_v2, (
                BROADCAST_GATHER_INTO,), {"shard": new, "world": 2, "group_name": "0", "_whole_base_index": 0,
                                          "_all_bases": [weights[k]]})
            nodes[f"cat{k}"] = result = g.call_function(operator.getitem, (issue, 1))
            nodes[f"wait{k}"] = g.call_function(c10d.wait_tensor.default, (result,))
        else:
            nodes[f"issue{k}"] = issue = g.call_function(c10d.broadcast.default, (new, 0, "0"))
            nodes[f"wait{k}"] = wait = g.call_function(c10d.wait_tensor.default, (issue,))
            nodes[f"cat{k}"] = g.call_function(aten.cat.default, ([wait, wait],))
    if read_old_weights_late:
        nodes["reader"] = g.call_function(aten.add.Tensor, (weights[0], 1.0))
    for k in range(2):
        nodes[f"write{k}"] = g.call_function(aten.copy_.default, (weights[k], nodes[f"cat{k}"]))
    g.output(tuple(nodes[f"write{k}"] for k in range(2)) + ((nodes["reader"],) if read_old_weights_late else ()))
    return g, nodes


@pytest.mark.parametrize("into_weights", [False, True])
def test_the_update_s_gathers_overlap_the_next_unit_s_adamw_and_write_back_at_once(into_weights):
    """Unit 0's gather is in flight while unit 1's AdamW computes (tests/plants.py:
    whole_step_update_gathers_waited_at_once), and its weights are written as soon as it completes, before
    unit 1's gather is issued, not at the graph's end (whole_step_update_written_back_late): a write-back left
    at the end keeps every unit's gathered copy alive to it, the whole model twice. Never before the wait:
    broadcast into the weights, the result is read through a getitem that precedes it, and written back from
    there it would copy slots still being received (comm_schedule_writes_back_before_the_wait)."""
    g, n = _update_graph(into_weights=into_weights)
    overlap(g, gather_depth=None, reductions=False, gathers_in_turn=True)
    g.lint()
    order = [m.name for m in g.nodes]
    at = {k: order.index(v.name) for k, v in n.items()}
    assert at["issue0"] < at["new1"] < at["wait0"], order
    assert at["cat0"] < at["write0"] < at["issue1"] and at["wait0"] < at["write0"], order


def test_a_write_back_stays_after_a_reader_of_the_old_weights():
    """A node that reads unit 0's old weights after its gather keeps the write-back after it (tests/plants.py:
    comm_schedule_writes_back_over_a_reader)."""
    g, n = _update_graph(read_old_weights_late=True)
    overlap(g, gather_depth=None, reductions=False, gathers_in_turn=True)
    order = [m.name for m in g.nodes]
    assert order.index(n["reader"].name) < order.index(n["write0"].name), order
