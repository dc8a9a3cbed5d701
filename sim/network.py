"""The network as it is built: nodes of `devices_per_node` devices on one fabric (NVLink), and
`nics_per_node` NICs per node between them. A collective is costed on the link its group really
runs on, found from the nodes the group spans, not from the world's size.

- A group inside one node runs at the node's fabric (the profile's `intra_node` bus bandwidth).
- A group across nodes runs as NCCL's rings run: one ring per channel, each channel leaving the
  node through its own NIC, so a ring's bus bandwidth is the NICs it can use together, capped by
  the fabric every rank's share of every ring also crosses (nccl-tests #160, #252; nccl #812: a
  DGX A100's 8 HDR NICs give ~192 GB/s of all-reduce bus bandwidth, not one NIC's 24).
  The groups of one kind run at once (every shard group, or every replica group, does the same
  collective at the same time) and share each node's NICs: a group with k of a node's g ranks
  gets k/g of its NICs. The slowest node of the slowest group sets the pace: the fewest ranks a
  group has in any node it spans.
- The latency is the slower hop's alpha, per hop of the ring.

NCCL does not split a collective hierarchically (reduce-scatter in the node, the cross-node part on
1/k of the bytes, all-gather in the node) for a flat group; its trees, for all-reduce, are bound by
the same NIC bandwidth at the sizes ZeRO moves. So neither is modelled: rings are what runs.

A profile without `nics_per_node` keeps the one-NIC network: a group across nodes runs at its
`inter_node` link as given (measured links included, e.g. gloo's times on CPU).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import lru_cache

from sim.cost import Link


def groups(size: int, stride: int, world: int) -> list[range]:
    """The groups of one kind in a world: `stride` 1, blocks of `size` consecutive ranks (the world,
    shard groups); else every `stride`-th rank from each of the first `stride` (replica groups)."""
    tiles = size >= 1 and stride >= 1 and (world % size == 0 if stride == 1 else world == size * stride)
    if not tiles:
        raise ValueError(f"groups of {size} ranks {stride} apart do not tile a world of {world}")
    if stride == 1:
        return [range(start, start + size) for start in range(0, world, size)]
    return [range(first, first + size * stride, stride) for first in range(stride)]


@lru_cache(maxsize=256)
def spread(size: int, stride: int, world: int, devices_per_node: int) -> tuple[int, int]:
    """(most nodes any group spans, fewest ranks a spanning group has in one of its nodes)."""
    nodes, fewest = 1, devices_per_node
    for members in groups(size, stride, world):
        per_node = Counter(r // devices_per_node for r in members)
        if len(per_node) > 1:
            nodes, fewest = max(nodes, len(per_node)), min(fewest, min(per_node.values()))
    return nodes, fewest


def group_link(intra: Link, inter: Link, devices_per_node: int, nics_per_node: int | None,
               size: int, stride: int = 1, world: int | None = None) -> Link:
    """The link that a group of `size` ranks, `stride` apart in a world of `world`, runs at."""
    world = size * stride if world is None else world
    nodes, fewest = spread(size, stride, world, devices_per_node)
    if nodes == 1:
        return intra
    if nics_per_node is None or inter.op_seconds or inter.op_bandwidth:
        return inter  # one NIC's network, or a network measured as a whole
    nics = nics_per_node * fewest / devices_per_node  # this group's share of the node's NICs
    return replace(inter, alpha_s=max(inter.alpha_s, intra.alpha_s),
                   bandwidth=min(intra.bandwidth, nics * inter.bandwidth))
