"""The layer over several nodes (mokgen/schedule/multinode.py plans it): tokens cross between
nodes through NCCL (torch.distributed all_to_all_single), deduplicated per destination node;
inside a node the generated node-local layer runs the (token, expert) pairs.

One GPU per node runs here (nodes x 1); nodes of several GPUs are planned and modelled
(docs/multinode.md) but refused at the call until their node-local path through the NVLink
megakernel has run on such a machine.
"""
from __future__ import annotations

import torch

from ..ir import MoESpec, SpecError
from .checks import InputError

# (group, device) -> the side stream the row exchange runs on
_STREAMS: dict = {}


def moe_multinode(x, topk_ids, topk_weights, w_gate, w_up, w_down, sizes, group, nodes: int, check_ids: bool):
    """out[t] for this rank's tokens; topk_ids global, the weights this rank's E/W experts."""
    import torch.distributed as dist

    from . import find_variant

    E_local, K, H, I, S = sizes
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or W % nodes:
        raise InputError(f"nodes must be a positive integer that divides the group's {W} ranks, got {nodes!r}")
    if S:
        raise InputError("a shared expert is not generated across nodes yet: pass ws_* = None (or nodes=1)")
    try:
        spec = MoESpec(experts=E_local * W, topk=K, hidden=H, intermediate=I, world_size=W, topology="nvlink",
                       nodes=nodes)
    except SpecError as e:
        raise InputError(f"these shapes cannot be generated over {nodes} nodes: {e}") from None
    if spec.gpus_per_node > 1:
        raise NotImplementedError(
            f"{nodes} nodes x {spec.gpus_per_node} GPUs: nodes of several GPUs are planned (mokgen show) but not run "
            "yet; one GPU per node runs (nodes = group size)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w_gate, w_up, w_down)):
        raise NotImplementedError("the layer over several nodes has no backward yet: call it under torch.no_grad()")
    from ..schedule.multinode import node_local_spec

    local = node_local_spec(spec)
    v = find_variant(local.experts, 1, H, I, 0)
    node, En = rank, spec.node_experts  # (one GPU per node: the rank is its node)
    T, dev = x.shape[0], x.device

    # Level 1: each token once to every other node one of its experts is on; send order:
    # destination node, then token. Everything the host must know (rows and pairs per node,
    # this rank's own pairs) is read back in one transfer, after one small exchange.
    # Bad input on any rank is found on the device and read with the sizes, so every rank raises
    # at the same point (one rank raising alone would leave the others waiting in the engine).
    valid = (topk_ids >= 0) & (topk_ids < spec.experts)
    bad = (~valid).any()
    if check_ids:
        bad = bad | ~torch.isfinite(x).all()
    node_of = torch.where(valid, topk_ids.long() // En, node)  # [T, K]; in range whatever the ids
    goes = torch.zeros(T, nodes, dtype=torch.bool, device=dev)
    goes.scatter_(1, node_of, True)
    goes[:, node] = False
    own = node_of == node
    pairs_to = torch.bincount(node_of.flatten(), minlength=nodes)
    pairs_to[node] = 0
    send_sizes = torch.stack([goes.sum(0), pairs_to, bad.long().expand(nodes)], 1)  # [nodes, (rows, pairs, bad)]
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    sc, rc, arrived_pairs, own_pairs, bad_ranks = read_sizes(
        torch.cat([send_sizes.flatten(), recv_sizes.flatten(), own.sum().view(1)]).tolist(), nodes)  # (the host read)
    if bad_ranks:
        raise InputError(f"topk_ids outside [0, {spec.experts})" + (" or x with NaN or Inf" if check_ids else "") +
                         f" on rank(s) {bad_ranks} of the group: nothing was computed (every rank raises this)")
    S, R = sum(sc), sum(rc)
    dest, tok = torch.nonzero_static(goes.t(), size=S).unbind(1)  # sorted by node, then token
    # A token's row and, per slot, its id on the destination node (-1: another node) and weight
    # (as int32 bits): one exchange for the rows, one for the slots.
    send_x = x[tok]
    on_dest = node_of[tok] == dest[:, None]
    send_slots = torch.cat([torch.where(on_dest, topk_ids[tok].long() - dest[:, None] * En, -1).to(torch.int32),
                            topk_weights[tok].view(torch.int32)], 1)
    recv_x = torch.empty(R, H, dtype=x.dtype, device=dev)
    recv_slots = torch.empty(R, 2 * K, dtype=torch.int32, device=dev)
    main = torch.cuda.current_stream(dev)
    key = (id(group), dev)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(dev)
    side = _STREAMS[key]
    side.wait_stream(main)
    with torch.cuda.stream(side):  # the rows travel while this node computes its own pairs
        dist.all_to_all_single(recv_x, send_x, rc, sc, group=group)
        dist.all_to_all_single(recv_slots, send_slots, rc, sc, group=group)
    for t in (send_x, send_slots, recv_x, recv_slots):
        t.record_stream(side)

    # Level 2: this rank's own pairs on its own node, then the pairs that arrived.
    own_sum = _pairs_sum(v, x, torch.where(own, topk_ids.long() - node * En, -1), topk_weights, own_pairs,
                         w_gate, w_up, w_down)
    main.wait_stream(side)
    arrived = _pairs_sum(v, recv_x, recv_slots[:, :K].long(), recv_slots[:, K:].view(torch.float32), arrived_pairs,
                         w_gate, w_up, w_down)

    # Return: one summed row per (token, node) back to the token's rank; the sum over nodes in
    # node order, in fp32, rounded once.
    back = torch.empty(S, H, dtype=torch.bfloat16, device=dev)
    dist.all_to_all_single(back, arrived.to(torch.bfloat16), sc, rc, group=group)
    acc = torch.zeros(T, H, dtype=torch.float32, device=dev)
    start = 0
    for m in range(nodes):
        if m == node:
            acc += own_sum
        elif sc[m]:
            rows = tok[start:start + sc[m]]  # distinct tokens: a deterministic update
            acc[rows] = acc[rows] + back[start:start + sc[m]].float()
        start += sc[m]  # (sc[node] is 0: no row goes to its own node)
    return acc.to(torch.bfloat16)


def read_sizes(sizes: list, nodes: int):
    """The call's one host read, [this rank's (rows, pairs, bad) per destination node, every
    rank's (rows, pairs, bad) for this one, this rank's own pairs], as (rows sent per node,
    rows received per node, pairs received, own pairs, ranks that found bad input)."""
    sent, got = sizes[:3 * nodes], sizes[3 * nodes:6 * nodes]
    return sent[0::3], got[0::3], sum(got[1::3]), sizes[6 * nodes], [m for m in range(nodes) if got[3 * m + 2]]


def _pairs_sum(v, rows, slot_ids, slot_w, pairs: int, w_gate, w_up, w_down):
    """fp32 [R, H]: per row j, the sum over its slots k with an id here (`pairs` of them in
    all), in slot order, of bf16(slot_w[j, k] * expert_{slot_ids[j, k]}(rows[j])), the experts
    run as the node-local generated layer over one weighted pair per row."""
    R, K = slot_ids.shape
    H = rows.shape[1]
    if pairs == 0:
        return torch.zeros(R, H, dtype=torch.float32, device=rows.device)
    j, k = torch.nonzero_static(slot_ids >= 0, size=pairs).unbind(1)  # (row, slot) order
    ids = slot_ids[j, k].to(torch.int32).view(pairs, 1)
    # (the variant itself, not its torch op: no autograd here, and the op's dispatch is host time)
    y = v.forward(rows[j], ids, slot_w[j, k].contiguous().view(pairs, 1), w_gate, w_up, w_down)
    dense = torch.zeros(R, K, H, dtype=torch.bfloat16, device=rows.device)
    dense[j, k] = y
    return dense.sum(1, dtype=torch.float32)  # one fixed-order sum over the slots: the same bits every run
