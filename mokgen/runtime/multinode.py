"""The layer over several nodes (mokgen/schedule/multinode.py plans it): tokens cross between
nodes through NCCL (torch.distributed all_to_all_single over the rail of GPUs with the same
local index), deduplicated per destination node; inside a node the generated node-local layer
runs the (token, expert) pairs: on one GPU the single-GPU layer, on several the NVLink
expert-parallel megakernel over the node's GPUs.
"""
from __future__ import annotations

import torch

from ..ir import MoESpec, SpecError
from ..schedule.dispatch import EMPTY_ID as EMPTY
from .checks import InputError

# (group, device) -> the side stream the counts and the row exchange run on
_STREAMS: dict = {}
# entries -> the pinned host buffer of the call's one host read
_HOST: dict = {}
# (group name, nodes) -> (rail group, node group): made once, by their members only
_LEVEL_GROUPS: dict = {}
# (variant, node group, device) -> the node-local layer's peer workspace (nodes of several GPUs)
_NODE_WORKSPACES: dict = {}
# The smallest node-local workspace, in token rows per rank: it grows in powers of two from here.
MIN_NODE_CAPACITY = 1024


def moe_multinode(x, topk_ids, topk_weights, w_gate, w_up, w_down, sizes, group, nodes: int, check_ids: bool,
                  fp8_local=None):
    """out[t] for this rank's tokens; topk_ids global, the weights this rank's E/W experts.

    fp8_local: the FP8 layer of this rank's experts (a callable (x, ids, weights) -> out, ids
    node-local with -1 for empty slots; the weights arguments are then None): one GPU per node
    only, the node-local layer being that GPU's (mokgen.moe_fp8(..., group=)).

    Ranks are node-major (rank = node * G + local index, G = GPUs per node). nodes=1 runs the
    levels too (no rows cross a network; the node-local layer is the megakernel over the group):
    the path the tests take where two GPUs cannot form two nodes of two. Ids of -1 are empty
    slots, as in the one-node layer."""
    import torch.distributed as dist

    from . import find_variant

    E_local, K, H, I, S = sizes
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or W % nodes:
        raise InputError(f"nodes must be a positive integer that divides the group's {W} ranks, got {nodes!r}")
    if S:
        raise InputError("a shared expert is not generated across nodes yet: pass ws_* = None (or nodes=1)")
    spec = levels_spec(E_local * W, K, H, I, W, nodes)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, topk_weights, w_gate, w_up, w_down)):
        raise NotImplementedError("the layer over several nodes has no backward yet: call it under torch.no_grad()")
    from ..schedule.multinode import node_local_spec

    local = node_local_spec(spec)
    G = spec.gpus_per_node
    weights = (w_gate, w_up, w_down)
    if fp8_local is not None:
        if G != 1:
            raise InputError(f"the FP8 layer across GPUs runs one GPU per node (nodes = the group's {W} ranks); "
                             f"got nodes={nodes}")

        def layer(xs, ids, w, peers=None):
            return fp8_local(xs, ids, w)
    else:
        v = find_variant(local.experts, K, H, I, 0, world_size=G)

        def layer(xs, ids, w, peers=None):
            return v.forward(xs, ids, w, *weights, peers=peers)
    node, En = rank // G, spec.node_experts
    rail, inside = level_groups(group, nodes, G)
    dev = x.device

    # Level 1: each token once to every other node one of its experts is on, over the rail (to
    # the GPU of the same local index there); send order: destination node, then token.
    # Everything the host must know (every rank's rows per node, its tokens, its verdict on its
    # input) is gathered over the group in one small collective and read back in one transfer.
    # Bad input on any rank is found on the device and read with the sizes, so every rank
    # raises at the same point (one rank raising alone would leave the others waiting in the
    # engine or in the node-local megakernel).
    node_of, goes, mine = route_to_nodes(x, topk_ids, spec.experts, nodes, node, En, check_ids)
    main = torch.cuda.current_stream(dev)
    key = (getattr(group, "group_name", id(group)), dev)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(dev)
    side = _STREAMS[key]
    # The gather and its copy to the host run on the side stream, so that (one GPU per node)
    # the own tokens' layer, which needs none of it, computes on the main stream meanwhile.
    counted = torch.cuda.Event()
    counted.record(main)
    side.wait_event(counted)
    table = torch.empty(W * mine.numel(), dtype=mine.dtype, device=dev)  # (flat: NCCL and gloo both take it)
    host = _host_buffer(table.numel())
    with torch.cuda.stream(side):
        dist.all_gather_into_tensor(table, mine, group=group)
        host.copy_(table, non_blocking=True)
        read = torch.cuda.Event()
        read.record(side)
    for t in (mine, table):
        t.record_stream(side)
    own_ids = own_slots(node_of, topk_ids, node, En)
    own_sum = layer(x, own_ids, topk_weights) if G == 1 else None
    read.synchronize()
    levels = read_levels(host.tolist(), nodes, G, rank)  # (the host read)
    raise_bad_input(levels, spec.experts, check_ids)
    sc, rc = levels["sent"], levels["received"]
    peers = None
    if G > 1:  # the node's megakernel: one workspace per node, grown together by its GPUs
        peers = node_workspace(v, inside, levels["node_rows"], dev)
    S_rows, R = sum(sc), sum(rc)
    # A token's row and its slots on the destination node: the ids there (node-local; -1, an
    # empty slot, for the other nodes' experts) and the weights (as int32 bits), packed and
    # exchanged on the side stream (which has the routing already), one exchange for the rows
    # and one for the slots, while the main stream computes this rank's own tokens.
    recv_x = torch.empty(R, H, dtype=x.dtype, device=dev)
    recv_slots = torch.empty(R, 2 * K, dtype=torch.int32, device=dev)
    with torch.cuda.stream(side):
        dest, tok = torch.nonzero_static(goes.t(), size=S_rows).unbind(1)  # sorted by node, then token
        if nodes > 1:
            send_x = x[tok]
            send_slots = slots_on(dest, tok, node_of, topk_ids, topk_weights, En)
            dist.all_to_all_single(recv_x, send_x, rc, sc, group=rail)
            dist.all_to_all_single(recv_slots, send_slots, rc, sc, group=rail)
    for t in (goes, node_of, recv_x, recv_slots, x, topk_ids, topk_weights):
        t.record_stream(side)
    tok.record_stream(main)  # (made on the side stream, read by the combine below)

    # Level 2: the node-local layer (top-K over the node's experts, the other nodes' slots
    # empty) over this rank's own tokens, then over the tokens that arrived; on a node of
    # several GPUs both calls are collective over the node (every GPU makes both, rows or not).
    if own_sum is None:
        own_sum = layer(x, own_ids, topk_weights, peers=peers)
    main.wait_stream(side)
    arrived = layer(recv_x, recv_slots[:, :K].contiguous(), recv_slots[:, K:].contiguous().view(torch.float32),
                    peers=peers)

    # Return: one row per (token, node) back to the token's rank (the node-local layer summed
    # its slots there in fp32 and rounded once); the sum over nodes in node order, in fp32,
    # rounded once more.
    back = torch.empty(S_rows, H, dtype=torch.bfloat16, device=dev)
    if nodes > 1:
        dist.all_to_all_single(back, arrived, sc, rc, group=rail)
    return sum_over_nodes(own_sum, back, tok, sc, node).to(torch.bfloat16)


def levels_spec(E: int, K: int, H: int, I: int, W: int, nodes: int) -> MoESpec:
    """The spec of the layer over `nodes` nodes of the group's W GPUs (E experts in all), or the
    caller's InputError naming the size the hardware or the generator cannot take."""
    try:
        return MoESpec(experts=E, topk=K, hidden=H, intermediate=I, world_size=W, topology="nvlink", nodes=nodes)
    except SpecError as e:
        raise InputError(f"these shapes cannot be generated over {nodes} nodes: {e}") from None


def route_to_nodes(x, topk_ids, experts: int, nodes: int, node: int, node_experts: int, check_ids: bool):
    """Where this rank's tokens go (its node `node`, node_experts experts per node):
    (node_of [T, K]: each slot's node, `nodes` for an empty or bad slot; goes [T, nodes]: the
    token has a slot on that node, False on its own; mine: its row of the gathered table, the
    rows it sends to each node, its tokens, and whether its input is bad (an id outside
    [0, experts) and not -1; with check_ids, a NaN or Inf in x too))."""
    T, dev = x.shape[0], x.device
    valid = (topk_ids >= 0) & (topk_ids < experts)
    bad = ((topk_ids < EMPTY) | (topk_ids >= experts)).any()
    if check_ids:
        bad = bad | ~torch.isfinite(x).all()
    node_of = torch.where(valid, topk_ids.long() // node_experts, nodes)
    goes = torch.zeros(T, nodes + 1, dtype=torch.bool, device=dev)
    goes.scatter_(1, node_of, True)
    goes = goes[:, :nodes]
    goes[:, node] = False
    mine = torch.cat([goes.sum(0), torch.full((1,), T, dtype=torch.int64, device=dev), bad.long().view(1)])
    return node_of, goes, mine


def raise_bad_input(levels: dict, experts: int, check_ids: bool) -> None:
    """The InputError every rank raises, at the same point, when any rank's input is bad."""
    if levels["bad_ranks"]:
        raise InputError(f"topk_ids outside [0, {experts}) and not -1" + (" or x with NaN or Inf" if check_ids
                                                                          else "") +
                         f" on rank(s) {levels['bad_ranks']} of the group: nothing was computed (every rank raises "
                         "this)")


def own_slots(node_of, topk_ids, node: int, node_experts: int) -> torch.Tensor:
    """This rank's tokens' ids as its own node reads them: int32 [T, K], node-local, the other
    nodes' slots empty (-1)."""
    return torch.where(node_of == node, topk_ids - node * node_experts, EMPTY).to(torch.int32)


def slots_on(dest, tok, node_of, topk_ids, topk_weights, node_experts: int) -> torch.Tensor:
    """The slots of the rows sent (token tok[i] to node dest[i]) as that node reads them: [rows,
    2K] int32, the ids node-local (-1, an empty slot, for the other nodes' experts) and the
    weights' fp32 bits."""
    on_dest = node_of[tok] == dest[:, None]
    return torch.cat([torch.where(on_dest, topk_ids[tok] - (dest[:, None] * node_experts).int(), EMPTY),
                      topk_weights[tok].view(torch.int32)], 1)


def sum_over_nodes(own: torch.Tensor, back: torch.Tensor, tok: torch.Tensor, sent: list, node: int) -> torch.Tensor:
    """fp32 [T, ...]: own (this node's part of each token) plus the rows that came back (back[i]
    for token tok[i], in send order: destination node, then token), summed in node order, the
    same order on every call (deterministic)."""
    acc = torch.zeros(own.shape, dtype=torch.float32, device=own.device)
    start = 0
    for m in range(len(sent)):
        if m == node:
            acc += own.float()
        elif sent[m]:
            rows = tok[start:start + sent[m]]  # distinct tokens: a deterministic update
            acc[rows] = acc[rows] + back[start:start + sent[m]].float()
        start += sent[m]  # (sent[node] is 0: no row goes to its own node)
    return acc


def _host_buffer(n: int) -> torch.Tensor:
    """A pinned int64 host buffer of n entries for the call's one host read, kept between calls
    (each call has read it before the next one writes it)."""
    if n not in _HOST:
        _HOST[n] = torch.empty(n, dtype=torch.int64, pin_memory=True)
    return _HOST[n]


def read_levels(table: list, nodes: int, G: int, rank: int) -> dict:
    """The call's one host read: every rank's row [rows it sends to each node (nodes), its
    tokens, whether its input is bad], flattened. What this rank needs of it: rows it sends
    and receives per node over its rail, the ranks with bad input, and node_rows: the most
    rows any GPU of its node passes to one node-local call (its tokens, or the rows that
    arrived: the same number on every GPU of the node)."""
    width = nodes + 2
    rows = [table[r * width:(r + 1) * width] for r in range(len(table) // width)]
    node, lane = divmod(rank, G)

    def arriving(r: int) -> int:
        n, g = divmod(r, G)
        return sum(rows[m * G + g][n] for m in range(nodes))

    members = range(node * G, (node + 1) * G)
    return dict(sent=rows[rank][:nodes], received=[rows[m * G + lane][node] for m in range(nodes)],
                bad_ranks=[r for r in range(len(rows)) if rows[r][nodes + 1]],
                node_rows=max(max(rows[r][nodes], arriving(r)) for r in members))


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
    """The node-local megakernel's peer workspace for calls of up to `rows` token rows per GPU.
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
