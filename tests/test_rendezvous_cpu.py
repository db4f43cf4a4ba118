"""The bounded host rendezvous before the expert-parallel layer's host collectives
(mokgen.runtime.peers.arrive), on CPU: two processes, a gloo group, its TCP store.

A rank that skips an attempt, or comes after the others' deadline, is reported on the
others as RendezvousTimeout, never a hang; the attempts after it are in step again.
"""
import socket
import time

import pytest

torch = pytest.importorskip("torch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, port: int, results):
    import torch.distributed as dist

    from mokgen.runtime.peers import RendezvousTimeout, arrive

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    group = dist.group.WORLD
    log = []

    def attempt(name, timeout_s):
        t0 = time.monotonic()
        try:
            arrive(group, "test", timeout_s)
            log.append((name, "ok", time.monotonic() - t0))
        except RendezvousTimeout as e:
            log.append((name, "timeout", time.monotonic() - t0, str(e)))

    attempt("both", 5.0)
    if rank == 0:  # rank 1 skips this one
        attempt("absent", 0.5)
    dist.barrier()
    attempt("both again", 5.0)
    if rank == 1:  # comes after rank 0 has given up
        time.sleep(1.5)
    attempt("late", 0.5)
    dist.barrier()
    attempt("in step after it", 5.0)
    results[rank] = log
    dist.barrier()
    dist.destroy_process_group()


def test_a_rank_that_never_arrives_is_reported_and_the_next_attempts_are_in_step():
    mp = torch.multiprocessing.get_context("spawn")
    results = mp.Manager().dict()
    port = free_port()
    procs = [mp.Process(target=worker, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    r0, r1 = results[0], results[1]
    by0, by1 = {e[0]: e for e in r0}, {e[0]: e for e in r1}
    for name in ("both", "both again", "in step after it"):
        assert by0[name][1] == "ok" and by1[name][1] == "ok", (r0, r1)
    assert by0["absent"][1] == "timeout" and 0.5 <= by0["absent"][2] < 3, r0
    assert "rank(s) 1 of the group did not arrive" in by0["absent"][3]
    # The late rank finds the attempt decided, waits in the next one, and is told too.
    assert by0["late"][1] == "timeout" and by1["late"][1] == "timeout", (r0, r1)
    assert "rank(s) 0 of the group did not arrive" in by1["late"][3]


def test_the_peer_memory_is_symmetric_unless_ipc_is_asked_for_and_anything_else_is_refused(monkeypatch):
    from mokgen.runtime import InputError
    from mokgen.runtime.peers import peer_memory

    monkeypatch.delenv("MOKGEN_PEER_MEMORY", raising=False)
    assert peer_memory() == "symmetric"
    monkeypatch.setenv("MOKGEN_PEER_MEMORY", "ipc")
    assert peer_memory() == "ipc"
    monkeypatch.setenv("MOKGEN_PEER_MEMORY", "nvshmem")
    with pytest.raises(InputError, match="MOKGEN_PEER_MEMORY='nvshmem'"):
        peer_memory()


def test_ranks_on_the_same_gpu_are_found_by_uuid_in_rank_order():
    from mokgen.runtime.peers import shared_gpus

    assert shared_gpus(["GPU-a", "GPU-b"]) == []
    assert shared_gpus(["GPU-a", "GPU-b", "GPU-a", "GPU-a"]) == [(0, 2), (0, 3)]
    assert shared_gpus([]) == []


def test_a_ranks_gradients_are_judged_against_its_slice_of_the_whole_layer():
    """mokgen.verify_ranks.rank_gradient_errors, on CPU: the exact float64 gradients of rank 1's
    tokens and experts (ranks of 5 and 3 tokens) have no error; rank 0's slice in their place does."""
    from mokgen.reference import moe_reference_backward
    from mokgen.verify_ranks import rank_gradient_errors

    g = torch.Generator().manual_seed(0)
    E, K, H, I = 8, 2, 64, 32
    weights = ((torch.randn(E, I, H, generator=g) / 8).bfloat16(), (torch.randn(E, I, H, generator=g) / 8).bfloat16(),
               (torch.randn(E, H, I, generator=g) / 6).bfloat16())
    every = [(torch.randn(T, H, generator=g).bfloat16(), torch.randint(0, E, (T, K), generator=g, dtype=torch.int32),
              torch.rand(T, K, generator=g), torch.randn(T, H, generator=g).bfloat16()) for T in (5, 3)]
    X, IDS, W, DOUT = (torch.cat([e[i] for e in every]) for i in range(4))
    ref = moe_reference_backward(DOUT, X, IDS, W, *weights)
    mine = slice(4, 8)
    exact = {"dx": ref["dx"][5:], "d_topk_weights": ref["d_topk_weights"][5:], "d_w_gate": ref["d_w_gate"][mine],
             "d_w_up": ref["d_w_up"][mine], "d_w_down": ref["d_w_down"][mine]}
    errors = rank_gradient_errors(exact, every, 1, weights, mine, (None, None, None))
    assert set(errors) == set(exact) and max(errors.values()) == 0.0
    wrong = dict(exact, dx=ref["dx"][:3], d_w_gate=ref["d_w_gate"][:4])
    errors = rank_gradient_errors(wrong, every, 1, weights, mine, (None, None, None))
    assert errors["dx"] > 0.1 and errors["d_w_gate"] > 0.1 and errors["d_w_up"] == 0.0
