"""What the step's compiled graphs hold: the collective pass inductor runs on each (zerofunc/whole_step.py
compiles the step with it), which buckets the graph's collectives as the step decides and then reads the
graph back: its collectives, and the most gathered bytes alive at any node."""
from __future__ import annotations

from dataclasses import dataclass

import torch

GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


@dataclass
class GraphCollectives:
    """What one compiled graph holds, read after the collective passes: its collectives in graph order
    (op name, bytes out), and the most bytes of gathered weights alive at any of its nodes."""

    collectives: list[tuple[str, int]]
    peak_gathered_bytes: int


class CollectivePass:
    """Inductor's post-grad pass for the step's graphs: buckets gathers and reduce-scatters up to
    `bucket_bytes` (adjacent ones only, so every rank issues the same), then records the graph.

    A plain callable, not a CustomGraphPass: inductor then bypasses its graph caches for these graphs, so
    the pass runs, and reads the graphs, on every compile (a cached graph would come back unread)."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self.graphs: list[GraphCollectives] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.fx_passes import bucketing
        cap_mb = lambda _bucket: self.bucket_bytes / 2**20  # noqa: E731
        if self.bucket_bytes:
            bucketing.bucket_all_gather(graph.owning_module, cap_mb)
            if hasattr(bucketing, "bucket_reduce_scatter"):  # not in every torch this runs on
                bucketing.bucket_reduce_scatter(graph.owning_module, cap_mb)
        self.graphs.append(read_collectives(graph))


def read_collectives(graph: torch.fx.Graph) -> GraphCollectives:
    """The collectives of `graph`, and the most bytes of all-gather output alive at once: each output lives
    from its gather to the last use of anything that aliases it (its wait, views, slices, a bucket's split;
    for a bucket gathered into a buffer, `out=`, that buffer's uses too)."""
    nodes = list(graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    collectives, spans = [], []
    for n in nodes:
        name = getattr(n.target, "__name__", str(n.target))
        if n.op != "call_function" or "_c10d_functional" not in str(n.target) or "wait" in name:
            continue
        val = n.meta.get("val")
        outs = val if isinstance(val, (list, tuple)) else [val]
        nbytes = sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
        collectives.append((name.split(".")[0], nbytes))
        if "all_gather" in name:
            heads = [n] + [a for a in [n.kwargs.get("out")] if isinstance(a, torch.fx.Node)]
            spans.append((where[n], max(_last_alias_use(h, where) for h in heads), nbytes))
    peak = max((sum(b for lo, hi, b in spans if lo <= i <= hi) for i in range(len(nodes))), default=0)
    return GraphCollectives(collectives, peak)


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
