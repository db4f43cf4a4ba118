"""The layer over several nodes, on the CPU: spec, levels, performance model, build and show."""
import json
import math
import subprocess
import sys

import pytest

from mokgen.ir import MoESpec, SpecError
from mokgen.schedule import PlanError, make_plan
from mokgen.schedule.multinode import describe, hierarchy, link_model, node_local_spec, remote_nodes_per_token
from mokgen.schedule.target import target_for


def spec(nodes=2, world=2, **kw):
    return MoESpec(**{**dict(experts=64, topk=8, hidden=2048, intermediate=1024, world_size=world,
                             topology="nvlink", nodes=nodes), **kw})


def test_spec_names_and_checks_the_nodes():
    s = spec()
    assert s.variant == "e64_k8_h2048_i1024_bf16_w2nvlink_n2_sm90a" and s.gpus_per_node == 1 and s.node_experts == 32
    assert "nodes" not in spec(nodes=1).to_dict()  # one node: the spec (and its variants) as before
    assert MoESpec.from_dict(s.to_dict()) == s
    with pytest.raises(SpecError, match="not divisible by nodes=3"):
        spec(nodes=3)
    with pytest.raises(SpecError, match="shared expert is not generated across nodes"):
        spec(shared_intermediate=512)
    with pytest.raises(SpecError, match="nodes must be"):
        spec(nodes=0)


def test_node_local_layer_is_top_k_over_the_nodes_experts():
    assert node_local_spec(spec()) == MoESpec(experts=32, topk=8, hidden=2048, intermediate=1024)
    eight = node_local_spec(spec(nodes=4, world=32, experts=256, hidden=7168, intermediate=2048))
    assert (eight.experts, eight.topk, eight.world_size, eight.topology) == (64, 8, 8, "nvlink")
    with pytest.raises(PlanError, match="spans 2 nodes"):
        make_plan(spec())


@pytest.mark.parametrize("nodes,world,experts", [(2, 4, 64), (4, 32, 256), (64, 512, 512)])
def test_nodes_of_several_gpus_plan_their_node_local_megakernel(nodes, world, experts):
    """The node-local layer of a node of G > 1 GPUs is the expert-parallel layer over them (top-K
    over the node's experts, other nodes' slots empty): it plans like any other, single launch included."""
    s = spec(nodes=nodes, world=world, experts=experts, hidden=7168, intermediate=2048)
    local = node_local_spec(s)
    plan = make_plan(local)
    assert local.world_size == world // nodes > 1 and local.topology == "nvlink" and local.topk == s.topk
    assert "forward_fused" in plan.steps and plan.steps["forward_fused"][0] == "gemm_fused"


def test_levels_say_what_overlaps_what():
    h = hierarchy(spec())
    stages = {s["name"]: s for s in h["stages"]}
    assert stages["exchange_rows"]["overlaps"] == "own_pairs" and stages["own_pairs"]["overlaps"] == "exchange_rows"
    assert stages["arrived_pairs"]["after"] == "exchange_rows" and "NCCL" in h["engine"]
    text = describe(h)
    assert "overlaps own_pairs" in text and "e32_k8_h2048_i1024_bf16_sm90a" in text


def test_link_model():
    s = spec()
    # K=8 of 64 experts over 2 nodes: the other node is hit unless all 8 are on this one
    miss = math.comb(32, 8) / math.comb(64, 8)
    assert remote_nodes_per_token(s) == pytest.approx(1 - miss)
    m = link_model(s, target_for("sm_90a"), 4096, net_gbs=50.0)
    row = 2048 * 2 + 8 * 8
    assert m["network_bytes_each_way"] == pytest.approx(4096 * (1 - miss) * (row + 2048 * 2))
    assert m["nvlink_bytes"] == 0 and 0 < m["hidden_fraction"] <= 1
    # more nodes: more of a token's rows leave, and the share of the work that hides them shrinks
    big = [link_model(spec(nodes=n, world=8 * n, experts=256, hidden=7168, intermediate=2048), target_for("sm_90a"),
                      8192, net_gbs=50.0) for n in (2, 8, 32)]
    assert big[0]["remote_nodes_per_token"] < big[1]["remote_nodes_per_token"] < big[2]["remote_nodes_per_token"]
    assert big[0]["nvlink_bytes"] > 0


def test_build_writes_the_levels_and_show_prints_them(tmp_path):
    cmd = [sys.executable, "-m", "mokgen.cli"]
    r = subprocess.run(cmd + ["build", "--world-size", "2", "--topology", "nvlink", "--nodes", "2", "--out",
                              str(tmp_path), "--no-compile"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = tmp_path / "e64_k8_h2048_i1024_bf16_w2nvlink_n2_sm90a"
    levels = json.loads((d / "hierarchy.json").read_text())
    assert levels["node_local"] == "e32_k8_h2048_i1024_bf16_sm90a"
    assert (tmp_path / "e32_k8_h2048_i1024_bf16_sm90a" / "manifest.json").exists()
    r = subprocess.run(cmd + ["show", str(d)], capture_output=True, text=True)
    assert r.returncode == 0 and "exchange_rows" in r.stdout and "node-local layer" in r.stdout
    r = subprocess.run(cmd + ["list", "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0 and "2 nodes x 1 GPU(s), node-local e32_k8_h2048_i1024_bf16_sm90a source only" in r.stdout
    r = subprocess.run(cmd + ["build", "--world-size", "2", "--topology", "nvlink", "--nodes", "3", "--no-compile"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not divisible by nodes=3" in r.stderr


def test_the_one_host_read_is_parsed_per_rail_and_node():
    """read_levels: every rank's [rows to each node, tokens, bad] over the group; what one rank
    of 2 nodes x 2 GPUs takes from it (its rail: the GPUs of its local index), and a rank that
    found bad input is named on every rank."""
    from mokgen.runtime.multinode import read_levels

    table = [0, 5, 11, 0,   # rank 0 (node 0, GPU 0): 5 rows to node 1, 11 tokens
             0, 3, 12, 0,   # rank 1 (node 0, GPU 1)
             4, 0, 13, 0,   # rank 2 (node 1, GPU 0)
             2, 0, 9, 0]    # rank 3 (node 1, GPU 1)
    got = read_levels(table, nodes=2, G=2, rank=1)
    # rank 1 sends 3 rows to rank 3 (its rail on node 1) and receives rank 3's 2; the node's
    # GPUs pass at most 12 rows to one call (rank 1's own tokens)
    assert got == dict(sent=[0, 3], received=[0, 2], bad_ranks=[], node_rows=12)
    assert read_levels(table, nodes=2, G=2, rank=2)["node_rows"] == 13  # node 1: rank 2's own tokens
    assert read_levels([0, 5, 1, 0, 0, 3, 1, 0, 40, 0, 13, 0, 2, 0, 9, 0], nodes=2, G=2, rank=0)["node_rows"] == 40
    table[3] = table[11] = 1  # ranks 0 and 2 found bad ids
    assert read_levels(table, nodes=2, G=2, rank=3)["bad_ranks"] == [0, 2]
    # one GPU per node: the rail is the group
    one = read_levels([0, 5, 11, 0, 4, 0, 13, 0], nodes=2, G=1, rank=0)
    assert (one["sent"], one["received"], one["node_rows"]) == ([0, 5], [0, 4], 11)
