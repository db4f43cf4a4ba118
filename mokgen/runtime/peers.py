"""The peer workspace of an expert-parallel variant: the Plan's symmetric and persistent
buffers, made once per (variant, process group, device) and reused by every call and layer.

Symmetric buffers live in torch symmetric memory (peer-to-peer mappings; NVLink multicast
is not used), so the generated kernels store straight into a peer's copy through the
addresses in ep_peers. Making a workspace is collective: every rank of the group makes it
in the same order, at the same capacity. Each such host collective starts with a bounded
rendezvous (`arrive`): a rank that never comes is reported as RendezvousTimeout on the
others after MOKGEN_RENDEZVOUS_TIMEOUT_S seconds (default 300), not a hang in NCCL.

MOKGEN_PEER_MEMORY=ipc maps the peers' buffers through CUDA IPC handles (torch.multiprocessing's)
instead: for several ranks on one GPU, which torch symmetric memory refuses. The kernels see the
same thing either way, an address per rank in ep_peers; the GPU then time-slices the ranks'
processes, so this is for testing the exchange at a world size with fewer GPUs, not for timing.
"""
from __future__ import annotations

import os
import time

import sympy
import torch

from ..ir.graph import RC as RC_SYM
from ..ir.graph import C as C_SYM
from ..schedule.expert_parallel import BACKWARD_REGIONS, REGIONS, STATE
from .checks import InputError
from .library import DTYPES

# How long a rank waits at a host rendezvous for the others (their first call may include
# loading the variant, or a slow data loader): long, but not forever.
RENDEZVOUS_TIMEOUT_S = 300.0
RENDEZVOUS_POLL_S = 0.01


class RendezvousTimeout(RuntimeError):
    """A rank of the process group did not reach a host rendezvous of the expert-parallel
    layer (making or growing the peer workspace) in time. Nothing was allocated; every rank
    that reached it raises this."""


def peer_memory() -> str:
    """How the peers' buffers are mapped: "symmetric" (torch symmetric memory, the default) or
    "ipc" (CUDA IPC handles: ranks may share a GPU)."""
    how = os.environ.get("MOKGEN_PEER_MEMORY", "symmetric")
    if how not in ("symmetric", "ipc"):
        raise InputError(f"MOKGEN_PEER_MEMORY={how!r}: expected 'symmetric' or 'ipc'")
    return how


def rendezvous_timeout_s() -> float:
    return float(os.environ.get("MOKGEN_RENDEZVOUS_TIMEOUT_S", RENDEZVOUS_TIMEOUT_S))


def arrive(group, what: str, timeout_s: float | None = None) -> None:
    """A bounded rendezvous of every rank of `group` on the c10d store, before a host
    collective that would otherwise wait without bound for a rank that never comes.

    Attempts are numbered: the current one is the first without a verdict in the store (an
    epoch key, advanced after each verdict, says where to start looking). Each rank marks
    itself arrived under it and waits until the attempt has a verdict. The first rank to see
    every rank arrived writes "ok", or past its deadline "fail". compare_set makes the first
    verdict the only one. Every rank of an attempt follows the same verdict, so none goes on
    into the collective alone. A rank that comes late or skipped the attempt finds its
    verdict and starts in step with the others' next attempt."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # a default group without a store: nothing to bound the wait with
        return
    timeout_s = rendezvous_timeout_s() if timeout_s is None else timeout_s
    base = f"mokgen/{getattr(group, 'group_name', 'group')}/{what}"
    epoch = int(store.add(f"{base}/epoch", 0))
    while store.check([f"{base}/{epoch}/verdict"]):  # decided attempts are over
        epoch += 1
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    store.set(f"{base}/{epoch}/arrived/{me}", "1")
    verdict_key = f"{base}/{epoch}/verdict"
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([verdict_key]):
            verdict = store.get(verdict_key).decode()
            break
        arrived = [r for r in ranks if store.check([f"{base}/{epoch}/arrived/{r}"])]
        if len(arrived) == len(ranks) or time.monotonic() > deadline:
            want = "ok" if len(arrived) == len(ranks) else "fail:" + ",".join(
                str(ranks.index(r)) for r in ranks if r not in arrived)
            verdict = store.compare_set(verdict_key, "", want).decode()
            if verdict == want:
                store.add(f"{base}/epoch", 1)  # the next attempt starts with fresh keys
            break
        time.sleep(RENDEZVOUS_POLL_S)
    if verdict != "ok":
        missing = verdict.split(":", 1)[1]
        raise RendezvousTimeout(f"expert-parallel {what}: rank(s) {missing} of the group did not arrive within "
                                f"{timeout_s:.0f} s (MOKGEN_RENDEZVOUS_TIMEOUT_S); every rank must make the same "
                                "expert-parallel calls in the same order. Nothing was allocated.")


def _shape(b: dict, capacity: int, recv_rows: int) -> tuple:
    return tuple(int(sympy.sympify(s, locals={"C": C_SYM, "RC": RC_SYM}).subs({C_SYM: capacity, RC_SYM: recv_rows}))
                 for s in b["shape"])


class PeerWorkspace:
    """Buffers of one expert-parallel variant for one process group, sized for `capacity`
    tokens per rank (what any rank may pass in one call) and `recv_rows` (token, expert) rows
    received per rank and call (default world * capacity * topk: every rank's pairs could go
    to one rank, so it never overflows; a call that would exceed a smaller bound is refused
    on the device). The forward's buffers are made at once, the backward's regions
    (BACKWARD_REGIONS) by the first call under autograd, so inference never holds them."""

    def __init__(self, plan: dict, group, capacity: int, device: torch.device, recv_rows: int | None = None):
        import torch.distributed as dist

        world = plan["spec"]["world_size"]
        if dist.get_world_size(group) != world:
            raise InputError(f"{plan['variant']} is built for {world} GPUs; the process group has "
                             f"{dist.get_world_size(group)}")
        self.group, self.capacity, self.device = group, capacity, device
        self.recv_rows = recv_rows or world * capacity * plan["spec"]["topk"]
        self.rank = dist.get_rank(group)
        self.buffers: dict[str, torch.Tensor] = {}
        self._handles = []  # the symmetric handles or the peers' IPC mappings, kept alive with the buffers
        self._plan = {b["name"]: b for b in plan["buffers"] if b["memory"] in ("symmetric", "persistent")}
        # (the persistent ones first: ep_peers receives the symmetric regions' addresses)
        self._make(sorted((n for n in self._plan if n not in BACKWARD_REGIONS),
                          key=lambda n: self._plan[n]["memory"] == "symmetric"))
        self.buffers["ep_state"][STATE.index("rank")] = self.rank

    def _make(self, names: list) -> None:
        """Allocate these buffers (collective: every rank makes the same ones, in order) and
        publish the symmetric ones' addresses in ep_peers."""
        import torch.distributed as dist

        share = self._ipc if peer_memory() == "ipc" else self._symmetric  # (before anything is allocated)
        for name in names:
            b = self._plan[name]
            if b["memory"] == "symmetric":
                t, ptrs = share(_shape(b, *self.sizes), DTYPES[b["dtype"]])
                self.buffers[name] = t
                self.buffers["ep_peers"][REGIONS.index(name)].copy_(torch.tensor(ptrs, dtype=torch.int64))
            else:
                self.buffers[name] = torch.zeros(_shape(b, *self.sizes), dtype=DTYPES[b["dtype"]],
                                                 device=self.device)
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def _symmetric(self, shape: tuple, dtype) -> tuple:
        """(this rank's buffer, every rank's address) from torch symmetric memory."""
        import torch.distributed._symmetric_memory as symm_mem

        t = symm_mem.empty(shape, dtype=dtype, device=self.device)
        t.zero_()  # flags start below every epoch; _make's barrier orders it before peers' stores
        handle = symm_mem.rendezvous(t, self.group.group_name)
        self._handles.append(handle)
        return t, list(handle.buffer_ptrs)

    def _ipc(self, shape: tuple, dtype) -> tuple:
        """(this rank's buffer, every rank's address) through CUDA IPC handles, exchanged with
        the group's all_gather_object; the peers' tensors are kept, so their mappings live as
        long as this workspace."""
        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor

        t = torch.zeros(shape, dtype=dtype, device=self.device)  # (zeros: as _symmetric's)
        torch.cuda.synchronize(self.device)  # zeroed before any peer can map and store into it
        shared = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(shared, reduce_tensor(t), group=self.group)
        ptrs = []
        for r, (rebuild, args) in enumerate(shared):
            if r == self.rank:
                ptrs.append(t.data_ptr())
                continue
            peer = rebuild(*args)
            self._handles.append(peer)
            ptrs.append(peer.data_ptr())
        return t, ptrs

    @property
    def sizes(self) -> tuple:
        """(C, RC): the capacity in tokens per rank, the bound on rows received per rank."""
        return self.capacity, self.recv_rows

    def missing(self, variant, entry: str) -> list:
        """The regions an entry point needs that do not exist yet."""
        if not variant.entry_buffers(entry) & set(BACKWARD_REGIONS):
            return []
        return [n for n in BACKWARD_REGIONS if n in self._plan and n not in self.buffers]

    def prepare(self, variant, entry: str) -> None:
        """Make the regions an entry point needs that do not exist yet. Collective (every rank
        at once, outside CUDA graph capture): the forward under autograd makes the backward's,
        so that the backward itself never waits on a host collective (a rank that skipped it
        would hang it; in the kernels, its absence is a bounded wait)."""
        missing = self.missing(variant, entry)
        if missing:
            if torch.cuda.is_current_stream_capturing():
                raise InputError(f"{variant.name}: the first expert-parallel call under autograd makes the peer "
                                 "workspace's backward regions (collective); run one before capturing a graph")
            arrive(self.group, f"{variant.name}/backward regions")
            self._make(missing)

    def poison(self) -> None:
        """NaN into every floating-point buffer (the rows, their routing weights; the counts,
        flags and addresses are integers), so that a row no rank wrote shows in a golden test.
        Every rank's stores must be ordered after it (a barrier) by the caller."""
        for t in self.buffers.values():
            if t.is_floating_point():
                t.fill_(float("nan"))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())


_WORKSPACES: dict = {}


def shared_gpus(uuids: list) -> list:
    """(first rank, rank) for each rank whose GPU (its UUID, the list in rank order) an earlier
    rank already has."""
    first, pairs = {}, []
    for r, u in enumerate(uuids):
        if u in first:
            pairs.append((first[u], r))
        else:
            first[u] = r
    return pairs


def workspace(variant, group, tokens: int, capacity: int | None, recv_rows: int | None = None) -> PeerWorkspace:
    """The workspace of (variant, group, device); made on first use. Its capacity is
    `capacity`, else the largest T any rank passes in that first call, and its receive bound
    `recv_rows` (default: never overflows), both agreed through one all-reduce, once. A later
    call with more tokens than the capacity, or another recv_rows, is refused: growing would
    need every rank to take part at the same moment."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    key = (variant.name, group.group_name if hasattr(group, "group_name") else id(group), device)
    ws = _WORKSPACES.get(key)
    if ws is None:
        arrive(group, f"{variant.name}/workspace")  # bounded: a rank that never comes is reported, not waited for
        if peer_memory() == "symmetric":
            uuids = [None] * dist.get_world_size(group)
            dist.all_gather_object(uuids, str(torch.cuda.get_device_properties(device).uuid), group=group)
            if pairs := shared_gpus(uuids):  # (every rank sees the same list: all raise, none waits)
                raise InputError(f"{variant.name}: ranks {pairs[0][0]} and {pairs[0][1]} of the group are on the same "
                                 "GPU; the expert-parallel layer takes one GPU per rank (torch symmetric memory maps "
                                 "one device per rank). MOKGEN_PEER_MEMORY=ipc runs ranks that share a GPU, for "
                                 "testing only: the GPU time-slices them")
        t = torch.tensor([tokens if capacity is None else capacity, recv_rows or 0], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        agreed_tokens, agreed_rows = t.tolist()  # (one copy to the host)
        capacity = max(1, agreed_tokens)
        ws = _WORKSPACES[key] = PeerWorkspace(variant.plan, group, capacity, device, agreed_rows or None)
    if recv_rows is not None and recv_rows != ws.recv_rows:
        raise InputError(f"{variant.name}: the expert-parallel workspace receives at most {ws.recv_rows} rows per rank "
                         f"and call, not recv_rows={recv_rows}; mokgen.release_peer_workspaces() (every rank) to make "
                         "it again")
    if tokens > ws.capacity:
        raise InputError(f"{variant.name}: T={tokens} exceeds the expert-parallel workspace's capacity of "
                         f"{ws.capacity} tokens per rank; pass max_tokens >= {tokens} to the first call of this "
                         "group (every rank at once), or mokgen.release_peer_workspaces() and start again")
    return ws


def release_all() -> None:
    """Free every peer workspace (collective in spirit: every rank should do it together)."""
    _WORKSPACES.clear()
