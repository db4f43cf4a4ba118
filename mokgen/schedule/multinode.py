"""Expert parallelism beyond one NVLink domain: the Plan of a layer over nodes x GPUs.

A spec with nodes > 1 spreads its E experts over world_size GPUs in `nodes` nodes (ranks
node-major: rank = node * G + local index, G = gpus_per_node; node n owns global experts
n*E/N .. (n+1)*E/N - 1, GPU g of it the E/W experts after n*E/N + g*E/W). A call runs in two
levels:

    level 1 (between nodes, the engine: NCCL through torch.distributed, never a transport of
    our own): each token goes once to every other node that owns one of its K experts, with
    its routing (the slots of that node's experts), over the rail of GPUs with the same local
    index (rank g of every node); deduplicated per destination node.
    level 2 (inside a node): the node's experts run this rank's own tokens and the tokens that
    arrived through the node-local generated layer: top-K over the node's E/N experts, the
    slots of other nodes' experts empty (id -1: no row, no work), on one GPU the single-GPU
    layer, on several the NVLink expert-parallel megakernel over the node's GPUs. Its combine
    sums a token's slots on the node (fp32, slot order) into one bf16 row per token and node.
    return: that row goes back over the rail; the token's rank sums the rows of its own node
    and of the others in node order (fp32), then rounds once more to bf16: deterministic.

What overlaps what: the exchange of the token rows runs on a stream of its own while the
rank computes its own tokens' pairs on its own node; the pairs that arrived run after it.

This module is pure data (no torch): the node-local spec, the stages, and the performance
model for N nodes of G GPUs (docs/multinode.md), which `mokgen show` prints.
"""
from __future__ import annotations

from ..ir import MoESpec
from .target import Target

ENGINE = "NCCL through torch.distributed (all_to_all_single over the rail group)"
# Bytes that travel with a token row besides its H bf16 values: its K slot ids (int32) and
# weights (fp32) for the destination node.
META_BYTES_PER_SLOT = 8


def node_local_spec(spec: MoESpec) -> MoESpec:
    """The layer each node runs over the tokens it holds: its E/N experts, top-K with the slots
    of other nodes' experts empty (id -1), over the node's GPUs."""
    G = spec.gpus_per_node
    return MoESpec(experts=spec.node_experts, topk=spec.topk, hidden=spec.hidden, intermediate=spec.intermediate,
                   dtype=spec.dtype, world_size=G, topology=spec.topology if G > 1 else "single", arch=spec.arch)


def remote_nodes_per_token(spec: MoESpec) -> float:
    """Expected number of other nodes a token's K experts lie on, under uniform routing
    (without replacement): (N - 1) * (1 - C(E - E/N, K) / C(E, K))."""
    E, K, N = spec.experts, spec.topk, spec.nodes
    miss = 1.0
    for i in range(K):  # P(none of the K distinct experts is on a given node)
        miss *= (E - spec.node_experts - i) / (E - i)
    return (N - 1) * (1.0 - max(miss, 0.0))


def link_model(spec: MoESpec, target: Target, tokens: int, net_gbs: float, nvlink_gbs: float | None = None) -> dict:
    """Per GPU and call, at `tokens` tokens per GPU, uniform routing: bytes over each link level
    and the times they and the expert GEMMs take, with the overlap the Plan schedules.

    net_gbs: the network rate per GPU each way (its rail NIC), nvlink_gbs: one GPU's NVLink
    rate inside a node (default: the target's measured peer rate)."""
    H, K, N, G = spec.hidden, spec.topk, spec.nodes, spec.gpus_per_node
    nvlink_gbs = nvlink_gbs or target.nvlink_peer_gbs
    remote = remote_nodes_per_token(spec)
    slots_per_node = K / N  # a token's expected slots on one node
    row = H * 2 + META_BYTES_PER_SLOT * K
    net_bytes = tokens * remote * (row + H * 2)  # each way: the token rows out, one summed row back per node
    # Inside the destination node, a pair whose expert is on another GPU of it crosses NVLink
    # there and back (the expert-parallel megakernel); every pair row is H bf16 values.
    pairs = tokens * K  # pairs this GPU's node-local layer holds (its own and the arrived ones)
    nvlink_bytes = pairs * (G - 1) / G * H * 2 * 2 if G > 1 else 0.0
    gemm_s = 6.0 * tokens * K * H * spec.intermediate / (target.grouped_gemm_tflops * 1e12)
    out_s = tokens * remote * row / (net_gbs * 1e9)  # the token rows out
    back_s = tokens * remote * H * 2 / (net_gbs * 1e9)  # one summed row per (token, node) back
    nvlink_s = nvlink_bytes / (nvlink_gbs * 1e9)
    # Inside a node the megakernel overlaps its NVLink traffic with its GEMMs (measured on 2
    # H200s at 8192 tokens per rank: 92-97% of one GPU's rate on the same work): the node-local
    # layer takes the longer of the two.
    local_s = max(gemm_s, nvlink_s)
    own = slots_per_node / K  # the share of the pairs on the token's own node
    # The token rows travel while the own node's pairs compute; the arrived pairs and the
    # return follow (the return overlaps nothing in this version).
    time_s = max(out_s, own * local_s) + (1 - own) * local_s + back_s
    return dict(nodes=N, gpus_per_node=G, tokens=tokens, remote_nodes_per_token=remote,
                network_bytes_each_way=net_bytes, nvlink_bytes=nvlink_bytes, gemm_ms=gemm_s * 1e3,
                network_ms=(out_s + back_s) * 1e3, nvlink_ms=nvlink_s * 1e3, predicted_ms=time_s * 1e3,
                hidden_fraction=min(out_s, own * local_s) / out_s if out_s else 1.0)


def hierarchy(spec: MoESpec) -> dict:
    """What the Plan says about the levels (written beside the node-local variant, printed by
    `mokgen show`)."""
    N, G, W = spec.nodes, spec.gpus_per_node, spec.world_size
    local = node_local_spec(spec)
    inside = (f"the NVLink expert-parallel megakernel over the node's {G} GPUs" if G > 1 else
              "the single-GPU layer (one GPU per node)")
    return dict(
        nodes=N, gpus_per_node=G, world_size=W, engine=ENGINE, node_experts=spec.node_experts,
        node_local_variant=local.variant,
        stages=[
            dict(name="route_to_nodes", where="every rank", what="per token, the other nodes its K experts are on "
                 "(deduplicated); send order: destination node, then token", stream="main"),
            dict(name="exchange_counts", where="whole group", what="every rank's rows and pairs per destination "
                 "node, own pairs and input verdict (one small all_gather; the host reads them in one transfer to "
                 "size the exchange and the node-local workspace)", stream="main"),
            dict(name="exchange_rows", where="rail group", what="each token's row and its slots on that node, once "
                 "per destination node", stream="network", overlaps="own_pairs"),
            dict(name="own_pairs", where="this rank's node", what=f"the pairs of this rank's tokens on its own node: "
                 f"{inside}", stream="main", overlaps="exchange_rows"),
            dict(name="arrived_pairs", where="this rank's node", what="the pairs of the tokens that arrived, the same "
                 "layer", stream="main", after="exchange_rows"),
            dict(name="sum_slots", where="every rank", what="per token and node, the node-local layer's combine: "
                 "its slots on the node, weighted, summed in fp32 in slot order, one bf16 row", stream="main"),
            dict(name="exchange_returns", where="rail group", what="one summed row per (token, node) back to the "
                 "token's rank", stream="main"),
            dict(name="combine", where="every rank", what="out[t] = bf16(sum over nodes in node order of the rows, "
                 "fp32): bitwise deterministic", stream="main"),
        ],
        decisions=[
            f"{N} nodes x {G} GPU(s): node n owns experts n*{spec.node_experts} .. (n+1)*{spec.node_experts}-1; "
            f"tokens cross the network once per destination node through {ENGINE}",
            f"inside a node: {inside}, generated as {local.variant} (top-{local.topk} over the node's "
            f"{local.experts} experts, the slots of other nodes' experts empty: id -1, no row, no work)",
            "overlap: the token rows travel on a stream of their own while the rank's own-node pairs compute",
            "the call reads every rank's per-node row counts on the host once (the engine's all_to_all needs its "
            "split sizes; the GPUs of a node size their shared workspace from the same numbers)",
        ],
    )


def describe(h: dict) -> str:
    """The hierarchy as text (mokgen show)."""
    out = [f"expert parallel over {h['nodes']} nodes x {h['gpus_per_node']} GPU(s) ({h['world_size']} ranks); "
           f"between nodes: {h['engine']}; inside a node: {h['node_local_variant']}", "stages (in order):"]
    for s in h["stages"]:
        extra = (f"; overlaps {s['overlaps']}" if s.get("overlaps") else "") + (
            f"; after {s['after']}" if s.get("after") else "")
        out.append(f"  {s['name']:17s} [{s['stream']}] {s['where']}: {s['what']}{extra}")
    out += ["decisions:"] + [f"  - {d}" for d in h["decisions"]]
    return "\n".join(out)
