"""The layer over several nodes (mokgen/schedule/multinode.py plans it): tokens cross between
nodes through NCCL (torch.distributed all_to_all_single over the rail of GPUs with the same
local index), deduplicated per destination node; inside a node the generated node-local layer
runs the (token, expert) pairs: on one GPU the single-GPU layer, on several the NVLink
expert-parallel megakernel over the node's GPUs.
"""
from __future__ import annotations

import torch

from ..ir import MoESpec, SpecError
from .checks import InputError

# (group, device) -> the side stream the row exchange runs on
_STREAMS: dict = {}
# (group name, nodes) -> (rail group, node group): made once, by their members only
_LEVEL_GROUPS: dict = {}
# (variant, node group, device) -> the node-local layer's peer workspace (nodes of several GPUs)
_NODE_WORKSPACES: dict = {}
# The smallest node-local workspace, in pair rows per rank: it grows in powers of two from here.
MIN_NODE_CAPACITY = 1024


def moe_multinode(x, topk_ids, topk_weights, w_gate, w_up, w_down, sizes, group, nodes: int, check_ids: bool):
    """out[t] for this rank's tokens; topk_ids global, the weights this rank's E/W experts.

    Ranks are node-major (rank = node * G + local index, G = GPUs per node). nodes=1 runs the
    levels too (no rows cross a network; the node-local layer is the megakernel over the group):
    the path the tests take where two GPUs cannot form two nodes of two."""
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
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w_gate, w_up, w_down)):
        raise NotImplementedError("the layer over several nodes has no backward yet: call it under torch.no_grad()")
    from ..schedule.multinode import node_local_spec

    local = node_local_spec(spec)
    G = spec.gpus_per_node
    v = find_variant(local.experts, 1, H, I, 0, world_size=G)
    node, En = rank // G, spec.node_experts
    rail, inside = level_groups(group, nodes, G)
    T, dev = x.shape[0], x.device

    # Level 1: each token once to every other node one of its experts is on, over the rail (to
    # the GPU of the same local index there); send order: destination node, then token.
    # Everything the host must know (every rank's rows and pairs per node, its own pairs, its
    # verdict on its input) is gathered over the group in one small collective and read back
    # in one transfer. Bad input on any rank is found on the device and read with the sizes,
    # so every rank raises at the same point (one rank raising alone would leave the others
    # waiting in the engine or in the node-local megakernel).
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
    mine = torch.cat([goes.sum(0), pairs_to, own.sum().view(1), bad.long().view(1)])
    table = torch.empty(W, mine.numel(), dtype=mine.dtype, device=dev)
    dist.all_gather_into_tensor(table, mine, group=group)
    levels = read_levels(table.flatten().tolist(), nodes, G, rank)  # (the host read)
    if levels["bad_ranks"]:
        raise InputError(f"topk_ids outside [0, {spec.experts})" + (" or x with NaN or Inf" if check_ids else "") +
                         f" on rank(s) {levels['bad_ranks']} of the group: nothing was computed (every rank raises "
                         "this)")
    sc, rc = levels["sent"], levels["received"]
    peers = None
    if G > 1:  # the node's megakernel: one workspace per node, grown together by its GPUs
        peers = node_workspace(v, inside, levels["node_rows"], dev)
    S_rows, R = sum(sc), sum(rc)
    dest, tok = torch.nonzero_static(goes.t(), size=S_rows).unbind(1)  # sorted by node, then token
    # A token's row and, per slot, its id on the destination node (-1: another node) and weight
    # (as int32 bits): one exchange for the rows, one for the slots.
    recv_x = torch.empty(R, H, dtype=x.dtype, device=dev)
    recv_slots = torch.empty(R, 2 * K, dtype=torch.int32, device=dev)
    main = torch.cuda.current_stream(dev)
    if nodes > 1:
        send_x = x[tok]
        on_dest = node_of[tok] == dest[:, None]
        send_slots = torch.cat([torch.where(on_dest, topk_ids[tok].long() - dest[:, None] * En, -1).to(torch.int32),
                                topk_weights[tok].view(torch.int32)], 1)
        key = (id(rail), dev)
        if key not in _STREAMS:
            _STREAMS[key] = torch.cuda.Stream(dev)
        side = _STREAMS[key]
        side.wait_stream(main)
        with torch.cuda.stream(side):  # the rows travel while this node computes its own pairs
            dist.all_to_all_single(recv_x, send_x, rc, sc, group=rail)
            dist.all_to_all_single(recv_slots, send_slots, rc, sc, group=rail)
        for t in (send_x, send_slots, recv_x, recv_slots):
            t.record_stream(side)

    # Level 2: this rank's own pairs on its own node, then the pairs that arrived (on a node of
    # several GPUs both calls are collective over the node: every GPU makes both, rows or not).
    weights = (w_gate, w_up, w_down)
    own_sum = _pairs_sum(v, x, torch.where(own, topk_ids.long() - node * En, -1), topk_weights,
                         levels["own_pairs"], weights, peers)
    if nodes > 1:
        main.wait_stream(side)
    arrived = _pairs_sum(v, recv_x, recv_slots[:, :K].long(), recv_slots[:, K:].view(torch.float32),
                         levels["arrived_pairs"], weights, peers)

    # Return: one summed row per (token, node) back to the token's rank; the sum over nodes in
    # node order, in fp32, rounded once.
    back = torch.empty(S_rows, H, dtype=torch.bfloat16, device=dev)
    if nodes > 1:
        dist.all_to_all_single(back, arrived.to(torch.bfloat16), sc, rc, group=rail)
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


def read_levels(table: list, nodes: int, G: int, rank: int) -> dict:
    """The call's one host read: every rank's row [rows it sends to each node (nodes), pairs it
    sends to each node (nodes), its own pairs, whether its input is bad], flattened. What this
    rank needs of it: rows it sends and receives per node over its rail, the pairs that arrive
    and its own, the ranks with bad input, and node_rows: the most pair rows any GPU of its node
    passes to one node-local call (the same number on every GPU of the node)."""
    width = 2 * nodes + 2
    rows = [table[r * width:(r + 1) * width] for r in range(len(table) // width)]
    node, lane = divmod(rank, G)

    def arriving(r: int) -> int:
        n, g = divmod(r, G)
        return sum(rows[m * G + g][nodes + n] for m in range(nodes))

    members = range(node * G, (node + 1) * G)
    return dict(sent=rows[rank][:nodes], received=[rows[m * G + lane][node] for m in range(nodes)],
                arrived_pairs=arriving(rank), own_pairs=rows[rank][2 * nodes],
                bad_ranks=[r for r in range(len(rows)) if rows[r][2 * nodes + 1]],
                node_rows=max(max(rows[r][2 * nodes], arriving(r)) for r in members))


def level_groups(group, nodes: int, G: int):
    """(rail, node): the process groups of this rank's rail (the GPUs of its local index, one per
    node) and of its node, made once per (group, nodes) by their members only. Where a level
    is the group itself it is reused; a level of one GPU is not needed (None)."""
    import torch.distributed as dist

    key = (getattr(group, "group_name", id(group)), nodes)
    if key not in _LEVEL_GROUPS:
        ranks = dist.get_process_group_ranks(group)  # group rank i is global rank ranks[i]
        node, lane = divmod(dist.get_rank(group), G)

        def make(members: list):
            if len(members) == 1:
                return None
            if len(members) == len(ranks):
                return group
            return dist.new_group([ranks[i] for i in members], use_local_synchronization=True)

        # (every rank makes its node's group, then its rail's: the same order everywhere)
        inside = make(list(range(node * G, (node + 1) * G)))
        rail = make([m * G + lane for m in range(nodes)])
        _LEVEL_GROUPS[key] = (rail, inside)
    return _LEVEL_GROUPS[key]


def node_workspace(v, inside, rows: int, device):
    """The node-local megakernel's peer workspace for calls of up to `rows` pair rows per GPU.
    Every GPU of the node computes the same `rows` from the gathered sizes, so when a call
    needs more than the workspace holds they all make a larger one (the next power of two)
    together: collective over the node, like the first."""
    from .peers import PeerWorkspace, arrive

    key = (v.name, getattr(inside, "group_name", id(inside)), device)
    ws = _NODE_WORKSPACES.get(key)
    if ws is None or rows > ws.capacity:
        capacity = MIN_NODE_CAPACITY
        while capacity < rows:
            capacity *= 2
        if ws is not None:
            torch.cuda.synchronize(device)  # the old workspace's last call is done before it goes
            del _NODE_WORKSPACES[key]
        arrive(inside, f"{v.name}/node workspace {capacity}")
        ws = _NODE_WORKSPACES[key] = PeerWorkspace(v.plan, inside, capacity, device)
    return ws


def _pairs_sum(v, rows, slot_ids, slot_w, pairs: int, weights, peers):
    """fp32 [R, H]: per row j, the sum over its slots k with an id here (`pairs` of them in
    all), in slot order, of bf16(slot_w[j, k] * expert_{slot_ids[j, k]}(rows[j])), the experts
    run as the node-local generated layer over one weighted pair per row. On a node of several
    GPUs (peers given) the call is the node's megakernel, which every GPU of the node makes."""
    R, K = slot_ids.shape
    H = rows.shape[1]
    if pairs == 0 and peers is None:
        return torch.zeros(R, H, dtype=torch.float32, device=rows.device)
    j, k = torch.nonzero_static(slot_ids >= 0, size=pairs).unbind(1)  # (row, slot) order
    ids = slot_ids[j, k].to(torch.int32).view(pairs, 1)
    # (the variant itself, not its torch op: no autograd here, and the op's dispatch is host time)
    y = v.forward(rows[j], ids, slot_w[j, k].contiguous().view(pairs, 1), *weights, peers=peers)
    dense = torch.zeros(R, K, H, dtype=torch.bfloat16, device=rows.device)
    dense[j, k] = y
    return dense.sum(1, dtype=torch.float32)  # one fixed-order sum over the slots: the same bits every run
