"""The call's error code: how long a wait may last before it is a bug, the codes, and how a
set code reaches the runtime's pinned host word (by an entry's last kernel where it can, else
by the one-thread status_mirror launch). mokgen/runtime/variant.py turns codes into errors."""
from __future__ import annotations

import dataclasses

from .records import KernelArg, KernelPlan


# A kernel's wait that lasts longer than this is a bug (a deadlock): the thread records an
# error code and gives up, the kernel ends, and the host raises KernelTimeout.
WAIT_TIMEOUT_MS = 10_000
# Once any thread has given up, the others notice within this long (a waiting thread reads
# the error code only after waiting this long, so a healthy wait never pays for it).
STATUS_POLL_NS = 1_000_000


# Error code dispatch_scatter records when some topk_ids are outside [0, E) and not EMPTY_ID
# (codes of the GEMMs' timed-out waits are 16 and up; mokgen/runtime/variant.py turns both
# into errors).
BAD_IDS_CODE = 1


# Tensors the runtime provides itself, bound by no Plan buffer: the variant's pinned host word
# for the call's error code (mokgen/runtime/variant.py).
RUNTIME_TENSORS = ("status_host",)
# A single launch's last CTA copies the call's error code to the host word itself, so its entry
# has one launch, not two (override mirror_status).
MIRROR_STATUS = True


def mirror_status_by_last_kernels(kernels: list, steps: dict, zeroed: dict, side_stream: list, n_counters: int,
                                  status_slot: int, finished_slot: int | None) -> tuple[list, list]:
    """(kernels, decisions): an entry's last kernel copies a set error code to the runtime's
    pinned host word itself where it can, so no status_mirror launch follows the entry (a
    launch costs a small call about 16 us of host time, docs/perf.md). An entry with
    side-stream kernels keeps status_mirror: they are joined only after its last kernel
    (runtime mirrored_entries).
    - A combine kernel records no error: its first thread copies the code as it starts, when
      every kernel before it on the stream has finished (harmless where it is not last).
    - A per-GEMM path's grouped GEMM may record one: each CTA counts itself in finished_slot
      once done, and the last copies the code (as the single launch does). So it must run last
      in every entry that runs it (the count is per launch), and the slot must start at 0: each
      of those entries dispatches (dispatch_count zeroes tile_counters) or the runtime zeroes
      tile_counters first.
    The single launch mirrors already; every other kernel keeps its params."""
    runs_in: dict = {}  # kernel -> the entries that run it
    for entry, names in steps.items():
        for n in names:
            runs_in.setdefault(n, []).append(entry)
    alone = {e for e in steps if not set(steps[e]) & set(side_stream)}  # entries on one stream
    marked, out = [], []
    for k in kernels:
        entries = runs_in.get(k.name, [])
        lasts = [e for e in entries if steps[e][-1] == k.name and e in alone]
        if k.params.get("mirror_status") or not lasts:
            out.append(k)
            continue
        if k.template == "combine.py.j2":
            extra = dict(status_slot=status_slot)
            args = [KernelArg("tile_counters", "tile_counters", "i32", [n_counters])]
            role = "thread 0 of CTA 0: a set error code (every kernel before it has finished) to pinned host memory"
        elif k.template == "grouped_gemm_persistent.py.j2" and not k.params.get("fused") \
                and finished_slot is not None and lasts == entries \
                and all(steps[e][0] == "dispatch_count" or "tile_counters" in zeroed.get(e, ()) for e in entries):
            extra, args = dict(finished_slot=finished_slot), []
            role = "thread 0 of the launch's last CTA: a set error code to pinned host memory"
        else:
            out.append(k)
            continue
        args.append(KernelArg("status_host", "status_host", "i32", [1]))
        # (before a profiling build's record, which stays last)
        at = next((i for i, a in enumerate(k.args) if a.name == "prof"), len(k.args))
        out.append(dataclasses.replace(k, params=dict(k.params, mirror_status=True, **extra),
                                       args=k.args[:at] + args + k.args[at:], warp_roles=k.warp_roles + [role]))
        marked.append(k.name)
    why = [f"{', '.join(marked)}: where it ends an entry, it copies a set error code to the runtime's pinned "
           "host word itself (no status_mirror launch behind that entry)"] if marked else []
    return out, why


def status_mirror(n_counters: int, status_slot: int) -> KernelPlan:
    """The one-thread launch behind every call that copies a set error code to the runtime's
    pinned host word (templates/status_mirror.py.j2): one warp, its first thread works."""
    threads = 32
    return KernelPlan(
        name="status_mirror", stage="status", module="status_mirror", template="status_mirror.py.j2", entry="main",
        params=dict(status_slot=status_slot, threads=threads),
        args=[KernelArg("tile_counters", "tile_counters", "i32", [n_counters]),
              KernelArg("status_host", "status_host", "i32", [1])],
        grid="(1,)", block=threads, warp_roles=["thread 0: the call's error code to pinned host memory, if set"])
