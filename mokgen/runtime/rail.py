"""The FP8 layer over a rail of GPUs (one GPU per node, tokens crossing through NCCL) under
autograd: mokgen.moe_fp8(..., group=) when x or topk_weights needs a gradient, and
mokgen.moe_fp8_train(..., group=).

Forward (collective: every rank of the group calls it):

1. the counts: every rank's rows per node and its verdict on its input, gathered over the
   group and read by the host once (multinode.route_to_nodes / read_levels): bad input on any
   rank raises on every rank, before any row moves;
2. there: each token once to every other node one of its experts is on (send order:
   destination node, then token), with its slots as that node reads them (node-local ids, the
   other nodes' slots empty);
3. the node-local FP8 layer, one call over this rank's own tokens and the rows that arrived
   (one call: the weight gradients of the rank's experts come from one backward, the gate/up
   products it saves are in one layout);
4. home: the arrived rows' outputs back to their tokens' ranks, summed with the own part in
   node order in fp32 and rounded once (multinode.sum_over_nodes; the no-grad forward of
   multinode.moe_multinode gives the same bits).

Backward (collective too): the output gradient's rows go the same way as the tokens went
(there), the node-local FP8 backward runs once over all rows (dx, d_topk_weights and, for
moe_fp8_train, the rank's experts' weight gradients), and the arrived rows' dx and
d_topk_weights come home in one exchange and are summed as in the forward: a slot's weight
gradient is non-zero on its expert's node only, so that sum is exact.

Every rank must run both: a rank that skips a call's backward (its loss not depending on the
output) leaves the others waiting in the exchange until the process group's timeout (the
`timeout` of init_process_group), as any collective does.

The row exchanges run on the caller's stream (no overlap: a training step's forward and
backward each wait for their rows anyway); the no-grad forward keeps multinode's overlap of the
own tokens with the exchange. The code is device-agnostic (the CPU tests run it over gloo with
an emulated node-local layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .multinode import (level_groups, own_slots, raise_bad_input, read_levels, route_to_nodes, slots_on,
                        sum_over_nodes)


@dataclass
class Crossing:
    """One call's rows between the ranks of a rail (rank r is node r): this rank's tokens that
    go to another node (tok, in send order), the rows it sends to and receives from each
    rank, and each slot's node."""
    group: object
    node: int
    node_experts: int
    tokens: int
    tok: torch.Tensor  # [sum(sent)] the token of each sent row
    dest: torch.Tensor  # [sum(sent)] its destination node
    node_of: torch.Tensor  # [T, K] each slot's node (`nodes` for an empty slot)
    sent: list
    received: list

    @classmethod
    def plan(cls, x, topk_ids, experts: int, group, check_ids: bool) -> Crossing:
        """The counts of a call (the gather over the group and the host read; collective).
        Raises InputError on every rank when any rank's input is bad."""
        import torch.distributed as dist

        W, rank = dist.get_world_size(group), dist.get_rank(group)
        rail, _ = level_groups(group, W, 1)  # (one GPU per node: the rail is the group)
        En = experts // W
        node_of, goes, mine = route_to_nodes(x, topk_ids, experts, W, rank, En, check_ids)
        table = torch.empty(W * mine.numel(), dtype=mine.dtype, device=x.device)  # (flat, as gloo wants it)
        dist.all_gather_into_tensor(table, mine, group=group)
        levels = read_levels(table.tolist(), W, 1, rank)  # (the host read)
        raise_bad_input(levels, experts, check_ids)
        dest, tok = torch.nonzero_static(goes.t(), size=sum(levels["sent"])).unbind(1)  # by node, then token
        return cls(rail, rank, En, x.shape[0], tok, dest, node_of, levels["sent"], levels["received"])

    def there(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows in send order ([sum(sent), ...]) to their nodes: the rows that arrive here
        ([sum(received), ...], by source node, then token; into out where given)."""
        import torch.distributed as dist

        if out is None:
            out = rows.new_empty((sum(self.received),) + tuple(rows.shape[1:]))
        if self.group is not None:
            dist.all_to_all_single(out, rows.contiguous(), self.received, self.sent, group=self.group)
        return out

    def home(self, rows: torch.Tensor) -> torch.Tensor:
        """The reverse of there: rows of the arrived tokens back to their ranks, in send order."""
        import torch.distributed as dist

        out = rows.new_empty((sum(self.sent),) + tuple(rows.shape[1:]))
        if self.group is not None:
            dist.all_to_all_single(out, rows.contiguous(), self.sent, self.received, group=self.group)
        return out

    def own_then_arrived(self, rows: torch.Tensor) -> torch.Tensor:
        """[T + sum(received), ...]: this rank's rows, then those the other ranks send for
        theirs (rows[tok] from each), in one buffer the exchange writes its part of."""
        T = self.tokens
        out = rows.new_empty((T + sum(self.received),) + tuple(rows.shape[1:]))
        out[:T] = rows
        self.there(rows[self.tok], out=out[T:])
        return out

    def local_rows(self, x, topk_ids, topk_weights):
        """(rows, ids, weights) of the node-local call: this rank's T tokens (ids node-local,
        the other nodes' slots empty), then the rows that arrived with their slots."""
        K = topk_ids.shape[1]
        own_ids = own_slots(self.node_of, topk_ids, self.node, self.node_experts)
        slots = self.there(slots_on(self.dest, self.tok, self.node_of, topk_ids, topk_weights, self.node_experts))
        return (self.own_then_arrived(x), torch.cat([own_ids, slots[:, :K]]),
                torch.cat([topk_weights, slots[:, K:].contiguous().view(torch.float32)]))

    def sum_home(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 [T, ...]: the node-local call's rows ([T + sum(received), ...]) summed per token:
        its own part plus its rows that come home, in node order."""
        T = self.tokens
        return sum_over_nodes(rows[:T], self.home(rows[T:]), self.tok, self.sent, self.node)


class FP8NodeLayer:
    """The node-local FP8 layer of one rank's experts (a generated variant's FP8 entries):
    what _FP8OverRail calls. weight_gradients: the backward also gives the experts' weight
    gradients (moe_fp8_train), else dx and d_topk_weights only (moe_fp8: frozen experts)."""

    def __init__(self, variant, experts, weight_gradients: bool, recompute: bool = False):
        self.variant, self.experts = variant, experts
        self.weight_gradients, self.save = weight_gradients, weight_gradients and not recompute

    def forward(self, x, ids, weights):
        """(out, saved): saved the gate/up products the backward reads (or None: it recomputes)."""
        if self.save:
            return self.variant.forward_fp8(x, ids, weights, self.experts, save=True)
        return self.variant.forward_fp8(x, ids, weights, self.experts), None

    def backward(self, dout, x, ids, weights, saved) -> dict:
        if self.weight_gradients:
            return self.variant.backward_fp8(dout, x, ids, weights, self.experts, a13=saved)
        dx, d_weights = self.variant.backward_data_fp8(dout, x, ids, weights, self.experts)
        return dict(dx=dx, d_topk_weights=d_weights)


def moe_over_rail(x, topk_ids, topk_weights, w_gate, w_up, w_down, layer, experts: int, group,
                  check_ids: bool) -> torch.Tensor:
    """The layer of `layer` (FP8NodeLayer, or any object with its forward / backward) over the
    group's ranks, one node each, under autograd: differentiable in x and topk_weights, and
    in w_gate, w_up, w_down (this rank's bf16 masters, or None) where layer gives weight
    gradients. experts: the group's experts in all; topk_ids global."""
    crossing = Crossing.plan(x, topk_ids, experts, group, check_ids)
    return _FP8OverRail.apply(x, topk_weights, w_gate, w_up, w_down, topk_ids, crossing, layer)


class _FP8OverRail(torch.autograd.Function):
    """See the module docstring. Saves the node-local call's rows (this rank's tokens and the
    arrived ones, with their ids and weights) and what the layer saved."""

    @staticmethod
    def forward(ctx, x, topk_weights, w_gate, w_up, w_down, topk_ids, crossing, layer):
        rows, ids, weights = crossing.local_rows(x, topk_ids, topk_weights)
        out, saved = layer.forward(rows, ids, weights)
        ctx.save_for_backward(rows, ids, weights, saved)
        ctx.crossing, ctx.layer = crossing, layer
        ctx.dtypes = tuple(w.dtype if w is not None else None for w in (w_gate, w_up, w_down))
        return crossing.sum_home(out).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, dout):
        rows, ids, weights, saved = ctx.saved_tensors
        c = ctx.crossing
        T, H = c.tokens, rows.shape[1]
        dout = dout.to(torch.bfloat16).contiguous()
        g = ctx.layer.backward(c.own_then_arrived(dout), rows, ids, weights, saved)
        # the arrived rows' dx and d_topk_weights home in one exchange (the fp32 weights as bf16 pairs)
        back = c.home(torch.cat([g["dx"][T:], g["d_topk_weights"][T:].contiguous().view(torch.bfloat16)], 1))
        dx = sum_over_nodes(g["dx"][:T], back[:, :H], c.tok, c.sent, c.node).to(torch.bfloat16)
        d_weights = sum_over_nodes(g["d_topk_weights"][:T], back[:, H:].contiguous().view(torch.float32), c.tok,
                                   c.sent, c.node)
        need = ctx.needs_input_grad
        grads = [g[k].to(dt) if need[2 + i] and k in g else None
                 for i, (k, dt) in enumerate(zip(("d_w_gate", "d_w_up", "d_w_down"), ctx.dtypes))]
        return (dx if need[0] else None, d_weights if need[1] else None, *grads, None, None, None)
