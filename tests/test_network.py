"""The two-level network (sim.network): a collective is costed on the link its group runs on, found
from the nodes the group spans. Expected links are stated from the profile's own figures (NVLink's
bus bandwidth, one NIC's, NICs per node), so they follow the figures, not the code."""
import dataclasses

import pytest

from sim.cost import Link
from sim.hardware import get_profile
from sim.network import group_link, groups, spread

H100 = get_profile("h100-sxm")
NVLINK, NIC, G = H100.intra_node, H100.inter_node, H100.devices_per_node


def test_the_h100_profile_is_a_dgx():
    assert (G, H100.nics_per_node) == (8, 8)


@pytest.mark.parametrize("size, stride, world", [(8, 1, 8), (8, 1, 64), (2, 1, 16), (4, 2, 8), (1, 1, 1)])
def test_a_group_inside_a_node_runs_on_the_fabric(size, stride, world):
    assert H100.link(size, stride, world) == NVLINK


@pytest.mark.parametrize("world", [16, 64, 128])
def test_a_world_of_whole_nodes_runs_on_all_its_nics_capped_by_the_fabric(world):
    link = H100.link(world)
    assert link.bandwidth == min(NVLINK.bandwidth, 8 * NIC.bandwidth)
    assert link.alpha_s == max(NVLINK.alpha_s, NIC.alpha_s)


@pytest.mark.parametrize("shard, nics", [(8, 1), (4, 2), (2, 4), (16, 1)])
def test_replica_groups_share_each_nodes_nics(shard, nics):
    """A replica group takes every shard-th rank: with shard >= 8 one rank per node, each on its own NIC;
    with shard 4 two ranks per node, while the node's 4 replica groups run at once on its 8 NICs."""
    world = 64
    assert H100.link(world // shard, shard, world).bandwidth == min(NVLINK.bandwidth, nics * NIC.bandwidth)


def test_a_group_straddling_nodes_is_paced_by_its_thinnest_node():
    """Shard groups of 3 in a world of 24: {6, 7, 8} has 2 ranks in node 0 and 1 in node 1."""
    assert spread(3, 1, 24, 8) == (2, 1)
    assert H100.link(3, 1, 24).bandwidth == 1 * NIC.bandwidth
    assert H100.link(12, 1, 12).bandwidth == min(NVLINK.bandwidth, 4 * NIC.bandwidth)  # 8 + 4 ranks


def test_a_profile_without_nics_keeps_its_network_link():
    one_nic = dataclasses.replace(H100, nics_per_node=None)
    assert one_nic.link(16) == NIC and one_nic.link(8) == NVLINK


def test_a_measured_network_is_used_as_measured():
    measured = Link(1e-5, 4e10, op_seconds={"all_gather": ((1.0, 1e-5), (1e6, 1e-3))})
    assert group_link(NVLINK, measured, 8, 8, 16) is measured


def test_groups_tile_the_world():
    assert groups(2, 1, 6) == [range(0, 2), range(2, 4), range(4, 6)]
    assert groups(3, 2, 6) == [range(0, 6, 2), range(1, 6, 2)]
    for bad in [(4, 1, 6), (3, 2, 12), (0, 1, 4)]:
        with pytest.raises(ValueError, match="do not tile"):
            groups(*bad)


def test_gpus_per_node_builds_the_network_of_those_nodes(capsys):
    """--gpus-per-node sets the network's devices per node, each GPU keeping its NIC: 16 ranks on nodes of
    4 are 4 nodes whose rings leave each node through 4 NICs (half a DGX's), on nodes of 16 one NVLink
    fabric. A stage-3 step sends the same bytes, its collectives slower or faster by those links; the
    profile's own 8 is the profile."""
    import json

    from zerofunc.plan import Plan
    from zerofunc.plan.__main__ import main as plan_main

    assert Plan(world_size=16, stage=3, gpus_per_node=G).profile == H100
    assert Plan(world_size=16, stage=3, gpus_per_node=4).profile.link(16).bandwidth == min(NVLINK.bandwidth, 4 * NIC.bandwidth)
    assert Plan(world_size=16, stage=3, gpus_per_node=16).profile.link(16) == NVLINK
    comm = {}
    for per_node in (4, 8, 16):
        assert plan_main(["--model", "gpt2-tiny", "--world-size", "16", "--stage", "3", "--levers", "none", "--json",
                          "--gpus-per-node", str(per_node)]) == 0
        comm[per_node] = json.loads(capsys.readouterr().out)["stages"][0]["comm"]
    assert comm[4]["volume_bytes"] == comm[8]["volume_bytes"] == comm[16]["volume_bytes"]
    assert comm[4]["time_s"] > comm[8]["time_s"] > comm[16]["time_s"]
