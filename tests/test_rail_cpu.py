"""The FP8 layer over a rail of GPUs under autograd (mokgen/runtime/rail.py: the row exchanges,
the one node-local call, the sums over nodes, forward and backward), on CPU: two processes, a
gloo group, and the float64 emulation of the FP8 kernels as each rank's node-local layer.

Each rank's output and gradients are compared with the emulation of the global layer (every
expert, every rank's tokens) on its tokens and its experts. Only the roundings differ: a
token's part from each node is rounded to bf16 before the sum over nodes (as the kernels
round theirs), and every expert's rows stay within one 128-row quantisation block of the
weight gradients, so a block's scales are the same in either order of its rows.
"""
import pytest

torch = pytest.importorskip("torch")

from test_rendezvous_cpu import free_port  # noqa: E402

E, K, H, I, W = 4, 2, 128, 256, 2


class EmulatedNodeLayer:
    """The node-local FP8 layer (rail.FP8NodeLayer's interface) as the float64 emulation of the
    kernels, its outputs in the kernels' dtypes."""

    def __init__(self, experts, weight_gradients: bool):
        self.experts, self.weight_gradients = experts, weight_gradients

    def forward(self, x, ids, weights):
        from mokgen.fp8 import moe_fp8_emulated

        return moe_fp8_emulated(x, ids, weights, self.experts).to(torch.bfloat16), None

    def backward(self, dout, x, ids, weights, saved):
        from mokgen.fp8 import moe_fp8_backward_data_emulated, moe_fp8_backward_emulated

        if not self.weight_gradients:
            dx, d_weights = moe_fp8_backward_data_emulated(dout, x, ids, weights, self.experts)
            return dict(dx=dx.to(torch.bfloat16), d_topk_weights=d_weights.float())
        g = moe_fp8_backward_emulated(dout, x, ids, weights, self.experts)
        return {k: v.float() if k == "d_topk_weights" else v.to(torch.bfloat16) for k, v in g.items()}


def routing(T, kind, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32) if T else \
        torch.zeros(0, K, dtype=torch.int32)
    if kind == "skewed":  # one hot expert (on rank 1), rank 0's experts empty but for a few tokens
        ids[:, 0] = E - 1
        ids[:, 1] = torch.where(torch.arange(T) % 5 == 0, 0, E - 2).to(torch.int32)
    elif kind == "dropped":  # empty slots, and every slot of token 0
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 1 / 3, -1, ids).to(torch.int32)
        ids[:1] = -1
    return ids, torch.softmax(torch.randn(T, K, generator=gen), -1)


def worker(rank: int, port: int, results):
    import torch.distributed as dist

    from mokgen.fp8 import moe_fp8_backward_emulated, moe_fp8_emulated, quantize_experts
    from mokgen.reference import rel_error as rel
    from mokgen.runtime import InputError
    from mokgen.runtime.rail import moe_over_rail

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=W, rank=rank)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(11)  # the same global weights and tokens on both ranks
    wg, wu = ((torch.randn(E, I, H, generator=gen) / H ** 0.5).to(torch.bfloat16) for _ in range(2))
    wd = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(torch.bfloat16)
    every = quantize_experts(wg, wu, wd)
    mine = slice(rank * E // W, (rank + 1) * E // W)
    local = quantize_experts(wg[mine].contiguous(), wu[mine].contiguous(), wd[mine].contiguous())
    log = []

    def case(name, tokens, kind, weight_gradients=True):
        xs = [torch.randn(T, H, generator=gen).to(torch.bfloat16) for T in tokens]
        routes = [routing(T, kind, gen) for T in tokens]
        douts = [torch.randn(T, H, generator=gen).to(torch.bfloat16) for T in tokens]
        ids, w = routes[rank]
        layer = EmulatedNodeLayer(local, weight_gradients)
        runs = []
        for _ in range(2):  # twice: the same bits
            leaves = [xs[rank].clone().requires_grad_(), w.clone().requires_grad_()]
            masters = [t[mine].clone().requires_grad_() for t in (wg, wu, wd)] if weight_gradients else [None] * 3
            out = moe_over_rail(leaves[0], ids, leaves[1], *masters, layer, E, group, True)
            out.backward(douts[rank])
            runs.append([out.detach()] + [t.grad for t in leaves + masters if t is not None])
        got = runs[0]
        # the global layer, emulated: every rank's tokens, every expert
        x_all, ids_all, w_all = torch.cat(xs), torch.cat([r[0] for r in routes]), torch.cat([r[1] for r in routes])
        start, T = sum(tokens[:rank]), tokens[rank]
        want_out = moe_fp8_emulated(x_all, ids_all, w_all, every)[start:start + T]
        g = moe_fp8_backward_emulated(torch.cat(douts), x_all, ids_all, w_all, every)
        errors = dict(out=rel(got[0], want_out), dx=rel(got[1], g["dx"][start:start + T]),
                      d_topk_weights=rel(got[2], g["d_topk_weights"][start:start + T]))
        if weight_gradients:
            for k, t in zip(("d_w_gate", "d_w_up", "d_w_down"), got[3:]):
                errors[k] = rel(t, g[k][mine])
        same = all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
        log.append((name, errors, same, [tuple(t.shape) for t in got], [t.dtype for t in got]))

    case("uniform", [40, 7], "uniform")
    case("skewed", [33, 50], "skewed")
    case("dropped", [21, 12], "dropped")
    case("one rank without tokens", [0, 9], "uniform")
    case("data gradients only (frozen experts)", [17, 30], "uniform", weight_gradients=False)
    # an id out of range on rank 1 only: every rank raises before any row moves
    ids, w = routing(5, "uniform", gen)
    if rank == 1:
        ids[2, 1] = E + 3
    try:
        moe_over_rail(torch.randn(5, H).to(torch.bfloat16), ids, w, None, None, None,
                      EmulatedNodeLayer(local, False), E, group, True)
        log.append(("bad ids on rank 1", "accepted"))
    except InputError as e:
        log.append(("bad ids on rank 1", str(e)))
    results[rank] = log
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def logs():
    mp = torch.multiprocessing.get_context("spawn")
    results = mp.Manager().dict()
    port = free_port()
    procs = [mp.Process(target=worker, args=(r, port, results)) for r in range(W)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    return [results[r] for r in range(W)]


# Bounds: a token's output and dx are rounded to bf16 on each node and once more after the sum
# (the global emulation once: a few bf16 steps, 2^-8 relative, on a few elements); a slot's
# weight gradient is computed on one node in fp32 (the emulation in float64); the weight
# gradients differ from the global emulation by the order of the sums and their bf16 rounding.
BOUNDS = dict(out=4e-3, dx=4e-3, d_topk_weights=1e-6, d_w_gate=4e-3, d_w_up=4e-3, d_w_down=4e-3)


@pytest.mark.parametrize("rank", range(W))
def test_output_and_gradients_over_two_ranks_match_the_global_layer(logs, rank):
    cases = [c for c in logs[rank] if len(c) == 5]
    assert len(cases) == 5
    for name, errors, same, shapes, dtypes in cases:
        for k, err in errors.items():
            assert err <= BOUNDS[k], (name, k, err)
        assert same, f"{name}: two runs gave different bits"
        T = shapes[0][0]
        assert shapes[:3] == [(T, H), (T, H), (T, K)], name
        assert dtypes[:3] == [torch.bfloat16, torch.bfloat16, torch.float32], name
        if "frozen" in name:
            assert len(shapes) == 3
        else:
            assert shapes[3:] == [(E // W, I, H), (E // W, I, H), (E // W, H, I)], name


@pytest.mark.parametrize("rank", range(W))
def test_bad_ids_on_one_rank_raise_on_every_rank(logs, rank):
    _, message = logs[rank][-1]
    assert "rank(s) [1]" in message and f"[0, {E})" in message, message
