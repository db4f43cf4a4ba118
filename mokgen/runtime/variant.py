"""A built variant: the Plan's steps run through the compiled kernels (its torch ops over
these entries: ops.py).

The runtime interprets the Plan: workspace buffers are allocated from their
symbolic shapes at the call's T, and each entry point (forward, route) launches
its kernels in the Plan's order on the current stream. No host synchronisation,
so a call can be captured in a CUDA graph.
"""


import ctypes
import functools
import json
import math
import re
from pathlib import Path

import sympy
import torch

from ..ir import MoESpec
from ..ir.graph import RC as RC_SYM
from ..ir.graph import C as C_SYM
from ..ir.graph import T as T_SYM
from ..schedule.expert_parallel import EP_ERROR, FLAG_KINDS, OVERFLOW_KIND
from ..schedule.backward import EP_SAVED_FOR_BACKWARD, SAVED_FOR_BACKWARD, backward_decision
from ..schedule.status import BAD_IDS_CODE, WAIT_TIMEOUT_MS
from .checks import InputError
from .library import DTYPES, BoundEntry, Launcher, cuda_stream, on_device, open_library
from .ops import PER_CALL_MEMORY, register_ops

LIB_NAME = "libmokgen.so"  # (what mokgen/codegen/build.py links; the runtime imports no codegen)
# An inference call's per-call buffers are kept for the next call of the same entry and T (same
# device and stream) when they take at most this much memory: allocating them (8 torch.empty a
# call) was the largest host item of a small eager call (docs/perf.md), while a large call's
# buffers (hundreds of MB at T=16384) would stay out of the allocator's reach between calls.
KEEP_WORKSPACE_BYTES = 64 << 20
# A training entry's (its slot's buffers are needed again at the next step anyway): the row
# buffers are padded per expert, so E64's backward takes 136 MB even at T = 64, and allocating
# it every step cost that step about 0.14 ms of host time (docs/perf.md). A step at a T whose
# scratch passes this is GPU-bound.
KEEP_TRAINING_BYTES = 256 << 20
# Entries whose kept workspace has a slot of its own (Variant._workspace).
_TRAINING_ENTRIES = ("forward_train", "backward", "backward_recompute")
class VariantNotBuilt(RuntimeError):
    pass


class KernelTimeout(RuntimeError):
    """A generated kernel gave up a wait that exceeded its bound (a deadlock, or a bug).
    The output of that call is invalid; the CUDA context stays usable."""


# Where a GEMM wait gave up (the low 4 bits of its error code; templates/bounded_wait.py.j2 and the GEMM templates).
WAIT_SITES = {1: "a consumer waiting for a loaded pipeline stage", 2: "the producer waiting for a free pipeline stage",
              3: "a warp waiting on the tile scheduler", 4: "a down tile waiting for its gate/up tiles (h_ready)",
              5: "the return waiting for an M tile's down tiles (down_ready)",
              6: "a CTA waiting for every expert to be counted, or placed (the dispatch inside the launch)",
              7: "the weight gradients' epilogue tile (its consumers waiting for it to be free, or its store warps for it)",
              8: "a combine task waiting for the down tiles of its token's rows (h_ready)"}


def mirrored_entries(plan: dict) -> frozenset:
    """The entries whose last kernel copies a set error code to the host word itself (Plan
    mirror_status: a single launch's last CTA, the per-GEMM path's combine, the backward's last
    GEMM): no status_mirror launch goes behind them. Not an entry with side-stream kernels,
    which are joined only after its last kernel."""
    params = {k["name"]: k["params"] for k in plan["kernels"]}
    side = set(plan.get("side_stream", ()))
    return frozenset(entry for entry, names in plan["steps"].items()
                     if names and params[names[-1]].get("mirror_status") and not side & set(names))


def timeout_message(variant: str, gemm_by_slot: dict, code: int, timeout_ms: int) -> str:
    """The error a timed-out wait's code (16 * (GEMM slot + 1) + wait site) turns into."""
    kernel = gemm_by_slot.get(code // 16 - 1, f"GEMM slot {code // 16 - 1}")
    site = WAIT_SITES.get(code % 16, f"wait site {code % 16}")
    return (f"{variant}: {kernel} gave up {site} after the {timeout_ms} ms bound (error code {code}): a deadlock "
            "or a bug, so that call's output is invalid; the CUDA context is still usable")


def status_error(variant: str, experts: int, gemm_by_slot: dict, code: int, timeout_ms: int) -> Exception:
    """The exception an error code the kernels recorded turns into (code != 0)."""
    if code == BAD_IDS_CODE:
        return InputError(f"{variant}: topk_ids of an earlier call held values outside [0, {experts}) (found on "
                          "the device; those pairs contributed nothing to that call's output)")
    if code >= EP_ERROR:
        kind, peer = divmod(code - EP_ERROR, 4096)
        if kind == OVERFLOW_KIND:
            return InputError(
                f"{variant}: rank {peer} would have received more (token, expert) rows in one call than the peer "
                "workspace holds (its recv_rows); every rank dropped that call, so its output (and gradients) are "
                "invalid. Make the workspace with a larger recv_rows (mokgen.release_peer_workspaces() on every rank, "
                "then mokgen.moe(..., recv_rows=...)), or route more evenly")
        what = FLAG_KINDS[kind] if kind < len(FLAG_KINDS) else f"message {kind}"
        return KernelTimeout(
            f"{variant}: rank {peer}'s {what} never arrived within the {timeout_ms} ms bound (error code {code}): "
            "that rank did not take part in the call (it failed, or called a different layer or token count "
            "order); this call's output is invalid and the group's peer workspace is out of step: release it "
            "(mokgen.release_peer_workspaces()) on every rank before the next call")
    return KernelTimeout(timeout_message(variant, gemm_by_slot, code, timeout_ms))


def bands_on_this_gpu(plan: dict, gpu: str | None = None) -> dict:
    """The Plan with launch_bands as measured on this GPU model (`gpu`, default the current
    device's, torch.cuda.get_device_name()): launch_bands_on[gpu] where `mokgen tune --paths`
    recorded them, else as planned."""
    on = plan.get("launch_bands_on") or {}
    if not on:
        return plan
    if gpu is None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
    return dict(plan, launch_bands=on[gpu]) if gpu in on else plan


def forward_entry(plan: dict, tokens: int) -> str:
    """The Plan's forward path for this many tokens: the first of plan["launch_bands"] (the single
    launch's tiles by T) that serves it, the fused launch up to plan["fused_max_tokens"] where the
    Plan has them, else the per-GEMM path. (Plans of mokgen 0.x before the bands had one small
    calls' launch up to plan["small_max_tokens"].)"""
    for top, entry in plan.get("launch_bands", []):
        if tokens <= top:
            return entry
    if "forward_small" in plan["steps"] and tokens <= plan.get("small_max_tokens", 0):
        return "forward_small"
    if "forward_fused" in plan["steps"] and tokens <= plan.get("fused_max_tokens", 0):
        return "forward_fused"
    return "forward"


def routes_in_launch(plan: dict, tokens: int) -> bool:
    """Whether a call from router logits runs the one launch that routes too: the Plan has it
    (the single-GPU fused launch that dispatches) and a single launch serves this T."""
    if "forward_routed" not in plan["steps"] or tokens == 0:
        return False
    return "forward_fused" not in plan["steps"] or forward_entry(plan, tokens) != "forward"


def routed_twin(entry: str) -> str:
    """The entry point of the launch that routes first, beside a single launch's entry:
    forward_fused's is forward_routed, forward_<band>'s forward_routed_<band>."""
    return "forward_routed" if entry in ("forward_fused", "forward") else entry.replace("forward_", "forward_routed_", 1)


def routed_entry(plan: dict, tokens: int) -> str:
    """The entry point that routes inside its launch for this T (where routes_in_launch)."""
    return routed_twin(forward_entry(plan, tokens))


def call_buffer_fns(plan: dict) -> list:
    """(name, dtype, [shape functions of (T, C, RC)], init) of the buffers allocated per call."""
    return [(b["name"], DTYPES[b["dtype"]],
             [sympy.lambdify((T_SYM, C_SYM, RC_SYM), sympy.sympify(s, locals={"T": T_SYM, "C": C_SYM, "RC": RC_SYM}),
                             "math") for s in b["shape"]], b["init"])
            for b in plan["buffers"] if b.get("memory", "call") == "call"]


def buffer_shapes_at(fns: list, tokens: int, sizes: tuple = (0, 0)) -> tuple:
    return tuple((name, dt, tuple(int(f(tokens, *sizes)) for f in shape), init) for name, dt, shape, init in fns)


def check_offsets(variant: str, shapes, tokens: int) -> None:
    """InputError when a buffer that grows with the tokens passes 2^31 elements at T = tokens
    (shapes(t): buffer_shapes_at's tuple at T = t). The generated kernels address rows with
    32-bit offsets; the weight gradients, whose size does not depend on T, are addressed per
    expert from 64-bit bases or by TMA."""
    def largest(t):  # (elements, name, shape) of the largest buffer that grows with T
        return max(((math.prod(s), name, s) for (name, _, s, _), (_, _, s1, _) in zip(shapes(t), shapes(1))
                    if s != s1), default=(0,))

    n, *where = largest(tokens)
    if n >= 2 ** 31:
        lo, hi = 1, tokens  # the most tokens one call takes (largest(lo) fits)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if largest(mid)[0] < 2 ** 31 else (lo, mid)
        raise InputError(f"{variant}: T={tokens} is too many tokens for one call: the buffer {where[0]} "
                         f"{list(where[1])} passes 2^31 elements, beyond the kernels' 32-bit offsets; split the "
                         f"batch into calls of at most {lo} tokens")


# State sets (the single launch's dispatch counters, a few ints each) made beside a device's first
# stream's, for the streams whose first call is inside a CUDA graph capture (Variant._state_buffer).
STATE_RESERVE = 4

# Where carved() starts each buffer in its block: TMA and the kernels' 16-byte accesses need
# 16 bytes; a cache line's worth costs nothing.
CARVE_ALIGN = 256


def carved(buffers, device) -> dict:
    """{name: tensor} for (name, dtype, shape) buffers, each a view of one uint8 allocation,
    starting at a multiple of CARVE_ALIGN bytes."""
    offsets, end = [], 0
    for name, dt, shape in buffers:
        offsets.append(end)
        end += -(-math.prod(shape) * dt.itemsize // CARVE_ALIGN) * CARVE_ALIGN
    block = torch.empty(end, dtype=torch.uint8, device=device)
    return {name: block[at:at + math.prod(shape) * dt.itemsize].view(dt).view(shape)
            for (name, dt, shape), at in zip(buffers, offsets)}


class Variant:
    def __init__(self, path: "Path"):
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.exists():
            raise VariantNotBuilt(f"{self.path} is not a mokgen variant (no manifest.json)")
        self.manifest = json.loads(manifest_path.read_text())
        self.plan = bands_on_this_gpu(self.manifest["plan"])
        self.spec = MoESpec.from_dict(self.manifest["spec"])
        self.name = self.manifest["variant"]
        lib = self.path / "build" / LIB_NAME
        if not lib.exists():
            raise VariantNotBuilt(
                f"variant {self.name} has no compiled kernels ({lib} missing): run "
                f"`mokgen build --from-manifest {self.path / 'manifest.json'}` where nvidia-cutlass-dsl is installed"
            )
        self._lib = open_library(lib)
        self.kernels = {k["name"]: k for k in self.plan["kernels"]}
        self.launchers = {name: Launcher(self._lib, k) for name, k in self.kernels.items()}
        # Buffers allocated per call, from T (and, expert parallel, the peer workspace's
        # capacity C); an expert-parallel variant's others live in its peer workspace
        # (runtime/peers.py).
        self._buffer_fns = call_buffer_fns(self.plan)
        # "state" buffers (the single launch's dispatch counters): zeroed once per device and
        # stream, then kept; the kernels leave them zeroed. One per stream, so calls on two
        # streams never share counters.
        self._state_shapes = {b["name"]: (DTYPES[b["dtype"]], tuple(int(d) for d in b["shape"]))
                              for b in self.plan["buffers"] if b.get("memory") == "state"}
        self._state: dict = {}  # (name, device, stream) -> tensor
        # device -> state sets made beside the first stream's, outside any capture, for the
        # streams that first call inside a CUDA graph capture: _state_buffer
        self._state_reserve: dict = {}
        # ("given" | "routed" | a training entry, device, stream) -> (T, buffers, the zero-initialised
        # ones, entry): _workspace
        self._kept: dict = {}
        self._empties: dict = {}  # (device, dtype) -> a zero-size tensor: _empty
        self.expert_parallel = self.spec.world_size > 1
        self._side_kernels = frozenset(self.plan.get("side_stream", ()))
        self._own_streams: dict = {}  # device -> (main, side): the streams of a two-stream entry
        # Kernels whose grid scales with T (none of their CTAs exist at T = 0): a rank of an
        # expert-parallel group without tokens still runs the rest, to serve its peers.
        self._token_grids = frozenset(k["name"] for k in self.plan["kernels"]
                                      if re.search(r"\bS?T\b", k["grid"]))
        # A profiling build records every task's SM and times (Plan override "profile");
        # it never takes over the torch ops of the normal build of the same variant.
        self.profiling = bool(self.plan.get("overrides", {}).get("profile"))
        self.last_records: dict = {}
        # The call's error code (0: none; a GEMM wait that timed out, or ids dispatch found out
        # of range) lands in the last tile_counters entry; the call's last kernel (or, where it
        # cannot, the one-thread status_mirror launch behind the call) writes it, when set, to a
        # pinned host word (the device addresses it directly), checked without a sync. (Builds
        # from before those copy the entry instead.)
        self._status_slot = next((k["params"]["status_slot"] for k in self.plan["kernels"]
                                  if "status_slot" in k["params"]), None)
        self._gemm_by_slot = {}  # (the fused launch and its routing twin share a slot: only one runs per call)
        for k in self.plan["kernels"]:
            if "sched_slot" in k["params"]:
                slot = k["params"]["sched_slot"]
                self._gemm_by_slot[slot] = " or ".join(filter(None, [self._gemm_by_slot.get(slot), k["name"]]))
        self._status_host = None
        self._status_event = None
        # Entries whose last kernel copies the error code to the host word itself (Plan
        # mirror_status): no status_mirror launch behind them (_run_and_report).
        self._mirrored = mirrored_entries(self.plan)
        self.ops = None if self.profiling else register_ops(self)

    # ---- buffers ----------------------------------------------------------------
    @functools.lru_cache(maxsize=64)
    def buffer_shapes(self, tokens: int, sizes: tuple = (0, 0)) -> tuple:
        """(name, dtype, shape, init) of the per-call buffers at T = tokens and (expert
        parallel) the peer workspace's sizes (C, RC)."""
        return buffer_shapes_at(self._buffer_fns, tokens, sizes)

    # Debug aid for the golden tests: fill every uninitialised workspace buffer with
    # NaN (floats) or -1 (ints) so that a read of anything not written shows up.
    poison = False

    @functools.lru_cache(maxsize=64)
    def check_offsets(self, tokens: int, sizes: tuple = (0, 0)) -> None:
        """See check_offsets (module level)."""
        check_offsets(self.name, lambda t: self.buffer_shapes(t, sizes), tokens)

    @functools.lru_cache(maxsize=16)
    def entry_buffers(self, entry: str) -> frozenset:
        """The workspace buffers an entry point's kernels use (only those are allocated)."""
        return frozenset(a["tensor"] for name in self.plan["steps"][entry] for a in self.kernels[name]["args"])

    @property
    def saved_names(self) -> tuple:
        """What the training forward saves for the backward: SAVED_FOR_BACKWARD; an expert-parallel
        variant saves the SwiGLU inputs only (its backward lays out the rows again)."""
        return EP_SAVED_FOR_BACKWARD if self.expert_parallel else SAVED_FOR_BACKWARD

    def _workspace(self, tokens: int, device, entry: str, peers=None, given=(), keep: bool = False,
                   fresh=()) -> dict:
        """The entry's buffers: the per-call ones allocated at this T (expert parallel: and at
        the peer workspace's sizes) but those the caller gives, then the peer workspace's own.
        keep: a workspace of at most KEEP_WORKSPACE_BYTES (a training entry's: KEEP_TRAINING_BYTES)
        is kept for the next call of the same entry and T on the same device and stream, which
        stream order makes safe (no kernel reads a per-call buffer before writing it;
        zero-initialised ones are zeroed again): one for the forward calls with routing given,
        one for those from router logits (the single launch's bands by T are several entries; a
        call at another T replaces the kept one, whichever band it takes), one for each training
        entry. fresh: buffers the call hands on (the training forward's saved tensors, which
        autograd holds until the backward): allocated every call, never kept. Never while a CUDA
        graph is captured, inside a custom op (per_call_memory: its state buffers are the call's
        own too), in poison or profiling mode."""
        slot = None
        per_call = PER_CALL_MEMORY.get()
        if keep and not per_call and peers is None and not given and not self.poison and not self.profiling \
                and not torch.cuda.is_current_stream_capturing():
            kind = "routed" if "routed" in entry else entry if entry in _TRAINING_ENTRIES else "given"
            slot = (kind, device, cuda_stream(device))
        sizes = peers.sizes if peers is not None else (0, 0)
        # the backward's saved tensors are the caller's (what the training forward returned)
        used = self.entry_buffers(entry).difference(self.saved_names if entry == "backward" else ()).difference(given)
        kept = self._kept.get(slot) if slot is not None else None
        reuse = kept is not None and kept[0] == tokens and kept[3] == entry
        if reuse:
            ws, zero_init = dict(kept[1]), kept[2]
            for t in zero_init:
                t.zero_()
        else:
            ws, zero_init = {}, []
            self.check_offsets(tokens, sizes)
        if not reuse or fresh:
            zeroed = self.plan.get("zeroed", {}).get(entry, ())
            # What the call hands on comes from one allocation (an allocation is several us of
            # a small step's host time), but inside a custom op, whose outputs may not alias.
            carve = [] if fresh and not per_call else None
            for name, dt, shape, init in self.buffer_shapes(tokens, sizes):
                if name not in used or (reuse and name not in fresh):
                    continue
                if init == "zeros" or name in zeroed:
                    ws[name] = torch.zeros(shape, dtype=dt, device=device)
                    if name not in fresh:
                        zero_init.append(ws[name])
                elif self.poison:
                    ws[name] = torch.full(shape, float("nan") if dt.is_floating_point else -1, dtype=dt, device=device)
                elif carve is not None and name in fresh:
                    carve.append((name, dt, shape))
                else:
                    ws[name] = torch.empty(shape, dtype=dt, device=device)
            if carve:
                ws.update(carved(carve, device))
        if slot is not None and not reuse:
            self._kept.pop(slot, None)  # (one kept workspace per slot: the last T's)
            keep_ws = {n: t for n, t in ws.items() if n not in fresh}
            cap = KEEP_TRAINING_BYTES if slot[0] in _TRAINING_ENTRIES else KEEP_WORKSPACE_BYTES
            if sum(t.numel() * t.element_size() for t in keep_ws.values()) <= cap:
                self._kept[slot] = (tokens, keep_ws, zero_init, entry)
        for name in used.intersection(self._state_shapes):
            ws[name] = self._state_buffer(name, device, per_call)
        if peers is not None:
            ws.update(peers.buffers)
        return ws

    def _empty(self, x):
        """A zero-size tensor of x's dtype and device, made once (nothing is ever written to it)."""
        key = (x.device, x.dtype)
        if key not in self._empties:
            self._empties[key] = x.new_empty(0)
        return self._empties[key]

    def release_workspaces(self) -> None:
        """Drop the buffers kept for the next small call (see _workspace); torch's allocator
        gets them back in stream order, and the next call allocates again."""
        self._kept.clear()

    def _state_buffer(self, name: str, device, per_call: bool = False):
        """The state buffer `name` of the current stream. A set made inside a CUDA graph
        capture would live in that graph's memory pool and be freed with the graph while later
        captures on the same stream still use it; so a stream that first calls inside a capture
        (torch's capture stream) takes one of STATE_RESERVE sets made, zeroed, beside the first
        stream's, outside any capture."""
        if per_call:  # (zeroed, as a kept one is between calls)
            dt, shape = self._state_shapes[name]
            return torch.zeros(shape, dtype=dt, device=device)
        stream = cuda_stream(device)
        key = (name, device, stream)
        if key not in self._state:
            if torch.cuda.is_current_stream_capturing():
                reserve = self._state_reserve.get(device)
                if not reserve:
                    raise InputError(
                        f"{self.name}: its first call on this device, or on more than {STATE_RESERVE} streams, is "
                        "inside a CUDA graph capture; call it once outside the capture first (a warm-up, as "
                        "torch.cuda.graphs asks): its dispatch counters are made then, outside the graph's memory")
                self._state.update({(n, device, stream): t for n, t in reserve.pop().items()})
            else:
                self._state.update({(n, device, stream): t for n, t in self._new_state_set(device).items()})
                if device not in self._state_reserve:  # (made once per device: a later stream takes none)
                    self._state_reserve[device] = [self._new_state_set(device) for _ in range(STATE_RESERVE)]
        return self._state[key]

    def _new_state_set(self, device) -> dict:
        return {n: torch.zeros(shape, dtype=dt, device=device) for n, (dt, shape) in self._state_shapes.items()}

    def _check_status(self, wait: bool) -> None:
        """Raise what an earlier call's kernels recorded (KernelTimeout for a timed-out wait,
        InputError for out-of-range ids). wait=False never blocks: it reads the host word that
        each call's last kernel (or the status_mirror launch behind it, _run_and_report) writes
        only when the call's error code is set, so a word still 0 is a call without error or one
        not finished yet (the next call, or check_errors, sees it). Builds from before those
        copy the code every call instead, and are read only once an event says the copy is done."""
        if self._status_host is None:
            return
        if wait or self._status_event is not None:
            if torch.cuda.is_current_stream_capturing():
                return  # no event query or sync may run inside a capture; replays are checked after
            if wait:
                torch.cuda.synchronize()
            elif not self._status_event.query():
                return
        code = self._status_word.value
        if code:
            if torch.cuda.is_current_stream_capturing():
                return  # (raised at the first call or check after the capture)
            self._status_word.value = 0
            for t in self._state.values():  # a launch that gave up a wait may leave counters raised
                t.zero_()  # (the reserve's sets are never used before a capture takes them)
            raise status_error(self.name, self.spec.experts, self._gemm_by_slot, code,
                               self.plan["overrides"].get("wait_timeout_ms", WAIT_TIMEOUT_MS))

    def check_errors(self) -> None:
        """Wait for this variant's launched work; raise KernelTimeout if a kernel gave up a
        wait, InputError if dispatch found topk_ids out of range."""
        self._check_status(wait=True)

    def _host_word(self) -> torch.Tensor:
        """The pinned host word the kernels copy a set error code to (allocated at first use)."""
        if self._status_host is None:
            self._status_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            # (read and reset through its address: indexing the tensor costs a few us a call)
            self._status_word = ctypes.c_int32.from_address(self._status_host.data_ptr())
        return self._status_host

    def _record_status(self, env: dict) -> None:
        if self._status_slot is None:
            return
        self._host_word()
        counters = env["tile_counters"]
        if "status_mirror" in self.launchers:  # (on the caller's stream, as run() would: one kernel, less host time)
            bound = dict(tile_counters=counters, status_host=self._status_host)
            self.launchers["status_mirror"]([bound[a["tensor"]] for a in self.kernels["status_mirror"]["args"]],
                                            cuda_stream(counters.device))
            return
        self._status_host.copy_(counters[self._status_slot:self._status_slot + 1], non_blocking=True)
        if not torch.cuda.is_current_stream_capturing():
            if self._status_event is None:  # one event, recorded again by every call
                self._status_event = torch.cuda.Event()
            self._status_event.record()

    def _run_and_report(self, entry: str, env: dict, device, skip=frozenset()) -> None:
        """run(), and the call's error code to the pinned host word: by the entry's last kernel
        itself where the Plan has it do so (mirrored entries; a rank without tokens that skips
        that kernel does not), else by the status_mirror launch behind the call."""
        if self._status_slot is not None:
            env["status_host"] = self._host_word()  # (every kernel that mirrors binds it)
        self.run(entry, env, device, skip=skip)
        if entry not in self._mirrored or self.plan["steps"][entry][-1] in skip:
            self._record_status(env)

    @functools.lru_cache(maxsize=64)
    def _steps(self, entry: str, skip: frozenset) -> tuple:
        """(name, the tensors it binds, whether it runs on the side stream) of each kernel of
        an entry but those skipped, in the Plan's order: looked up once, not at every call.
        (The launchers are looked up at the call: a benchmark may wrap them.)"""
        return tuple((n, tuple(a["tensor"] for a in self.kernels[n]["args"]), n in self._side_kernels)
                     for n in self.plan["steps"][entry] if n not in skip)

    @functools.lru_cache(maxsize=64)
    def _bound(self, entry: str, skip: frozenset) -> BoundEntry:
        steps = self._steps(entry, skip)
        return BoundEntry([self.launchers[n] for n, _, _ in steps], [names for _, names, _ in steps])

    def run(self, entry: str, env: dict, device, skip=frozenset()) -> None:
        skip = frozenset(skip)
        steps = self._steps(entry, skip)
        try:
            if not any(side for *_, side in steps):  # one stream: the caller's
                stream, launchers = cuda_stream(device), self.launchers
                if all(type(launchers[name]) is Launcher for name, _, _ in steps):
                    self._bound(entry, skip)(env, stream)
                    return
                for name, names, _ in steps:  # (a benchmark wrapped some launchers)
                    launchers[name]([env[n] for n in names], stream)
                return
            self._run_two_streams(steps, env, device)
        except KeyError:
            missing = {n: [t for t in names if t not in env] for n, names, _ in steps}
            missing = {n: m for n, m in missing.items() if m}
            raise KeyError(f"{self.spec.variant}: kernels need tensors this call did not give: {missing}") from None

    def _run_two_streams(self, steps: tuple, env: dict, device) -> None:
        # Both streams are the variant's own: work on the legacy default stream waits for
        # everything launched before it on blocking streams, which would put a kernel that
        # waits for the side stream's progress behind it.
        caller = torch.cuda.current_stream(device)
        main, side_stream = self._streams(device)
        main.wait_stream(caller)
        forked = False
        for name, names, side in steps:
            stream = main
            if side:  # forked here, so it runs beside the kernels after it
                side_stream.wait_stream(main)
                stream, forked = side_stream, True
            self.launchers[name]([env[n] for n in names], stream.cuda_stream)
        # joined: the caller's later work, and the call's buffers' reuse, come after it all
        caller.wait_stream(main)
        if forked:
            caller.wait_stream(side_stream)

    def _streams(self, device) -> tuple:
        if device not in self._own_streams:
            self._own_streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._own_streams[device]

    def forward_entry(self, tokens: int) -> str:
        return forward_entry(self.plan, tokens)

    # ---- entry points (no checks here: the public functions check) ---------------
    def forward(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None,
                out=None, peers=None):
        """peers: the PeerWorkspace of an expert-parallel variant (runtime/peers.py); its
        weights are the rank's local experts and topk_ids hold global expert ids."""
        tokens = x.shape[0]
        if out is None:
            out = torch.empty_like(x)
        if self.spec.dtype == "fp8":
            raise InputError(f"{self.name} is an FP8 layer: call mokgen.moe_fp8 with the experts from "
                             "mokgen.fp8.quantize_experts")
        if self.expert_parallel and peers is None:
            raise InputError(f"{self.name} is expert parallel: call it through mokgen.moe(..., group=...)")
        if tokens == 0 and not self.expert_parallel:  # (a rank without tokens still serves its peers)
            return out
        env = self._run_forward(self.forward_entry(tokens), x, dict(topk_ids=topk_ids, topk_weights=topk_weights),
                                w_gate, w_up, w_down, ws_gate, ws_up, ws_down, out, peers)
        if self.profiling:
            self.last_records = {n[len("prof_"):]: env[n] for n in env if n.startswith("prof_")}
        return out

    def _run_forward(self, entry, x, routing: dict, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, out, peers=None):
        """Launch a forward entry point over its workspace (allocated at T = x.shape[0]) and
        record the call's error code; returns the workspace. routing: topk_ids and
        topk_weights (inputs, or the outputs of a launch that routes) and any logits."""
        tokens = x.shape[0]
        self._check_status(wait=False)  # an error of an earlier, finished call surfaces here
        with on_device(x.device):
            env = self._workspace(tokens, x.device, entry, peers, keep=True)
            env.update(routing, x=x, w_gate=w_gate, w_up=w_up, w_down=w_down, out=out)
            if ws_gate is not None:
                env.update(ws_gate=ws_gate, ws_up=ws_up, ws_down=ws_down)
            self._run_and_report(entry, env, x.device, skip=self._token_grids if tokens == 0 else ())
        return env

    def forward_fp8(self, x, topk_ids, topk_weights, experts, out=None, save: bool = False):
        """The FP8 layer's forward (dtype fp8): experts are mokgen.fp8.FP8Experts (no checks here:
        mokgen.moe_fp8 checks). save: the training forward, which also returns the gate/up
        products (a13, bf16 in dispatch's row layout) for backward_fp8: (out, a13)."""
        tokens = x.shape[0]
        if out is None:
            out = torch.empty_like(x)
        a13 = None
        if save:  # (no rows without tokens)
            shape = next(s for name, _, s, _ in self.buffer_shapes(tokens) if name == "a13") if tokens else \
                (0, 2 * self.spec.intermediate)
            a13 = torch.empty(shape, dtype=torch.bfloat16, device=x.device)
        if tokens > 0:
            self._check_status(wait=False)
            entry = "forward_train" if save else "forward"
            with on_device(x.device):
                env = self._workspace(tokens, x.device, entry, given=("a13",) if save else ())
                env.update(x=x, topk_ids=topk_ids, topk_weights=topk_weights, out=out,
                           w13_q=experts.gate_up.values, w13_scales=experts.gate_up.scales,
                           w_down_q=experts.down.values, w_down_scales=experts.down.scales)
                if save:
                    env["a13"] = a13
                self._run_and_report(entry, env, x.device)
        return (out, a13) if save else out

    def quantize_experts_fp8(self, w_gate, w_up, w_down):
        """The experts' FP8 weights (mokgen.fp8.FP8Experts, with the backward's transposed
        copies) from bf16 masters w_gate, w_up [E, I, H] and w_down [E, H, I], on their GPU by the
        Plan's quantize_experts kernels: the same bits as mokgen.fp8.quantize_experts. No checks
        here (mokgen.moe_fp8_train checks)."""
        from ..fp8 import BLOCK, FP8Experts, FP8Weights

        E, I, H = self.spec.experts, self.spec.intermediate, self.spec.hidden
        dev = w_gate.device

        def weights(n, k):
            return (FP8Weights(torch.empty(E, n, k, dtype=torch.float8_e4m3fn, device=dev),
                               torch.empty(E, n // BLOCK, k // BLOCK, device=dev)),
                    FP8Weights(torch.empty(E, k, n, dtype=torch.float8_e4m3fn, device=dev),
                               torch.empty(E, k // BLOCK, n // BLOCK, device=dev)))

        (w13, w13_t), (down, down_t) = weights(2 * I, H), weights(H, I)
        env = dict(w_gate=w_gate, w_up=w_up, w_down=w_down)
        for name, (w, t) in (("w13", (w13, w13_t)), ("w_down", (down, down_t))):
            env.update({f"{name}_q": w.values, f"{name}_scales": w.scales, f"{name}_t_q": t.values,
                        f"{name}_t_scales": t.scales})
        with on_device(dev):
            self.run("quantize_experts", env, dev)
        return FP8Experts(w13, down, w13_t, down_t)

    def backward_data_fp8(self, dout, x, topk_ids, topk_weights, experts):
        """(dx, d_topk_weights) of the FP8 layer (dtype fp8) for the output gradient dout: its
        data gradients, recomputing the forward's products (backward_fp8: every gradient).
        Pairs without a row (empty slots, ids out of range) get a
        d_topk_weights of 0. No checks here."""
        dx, d_weights = self._data_gradient_outputs(x, topk_ids, topk_weights)
        if x.shape[0] == 0:
            return dx, d_weights
        self._check_status(wait=False)
        with on_device(x.device):
            env = self._workspace(x.shape[0], x.device, "backward_data")
            env.update(self._fp8_backward_inputs(dout, x, topk_ids, topk_weights, experts, dx, d_weights))
            self._run_and_report("backward_data", env, x.device)
        return dx, d_weights

    def backward_fp8(self, dout, x, topk_ids, topk_weights, experts, a13=None) -> dict:
        """Every gradient of the FP8 layer (dtype fp8) for the output gradient dout, through the
        Plan's backward_fp8 entry (recomputing the forward's products; a13, the products
        forward_fp8(save=True) returned: backward_fp8_saved, which reads them): dx, d_topk_weights
        (pairs without a row: 0), and the weight gradients d_w_gate, d_w_up [E, I, H] and
        d_w_down [E, H, I] in bf16 (an expert without rows: zeros). No checks here."""
        E, I, H = self.spec.experts, self.spec.intermediate, self.spec.hidden
        fill = (lambda shape: torch.full(shape, float("nan"), dtype=torch.bfloat16, device=x.device)) if self.poison \
            else (lambda shape: torch.empty(shape, dtype=torch.bfloat16, device=x.device))
        # (the weight-gradient GEMMs write w_gate's and w_up's rows apart, in these layouts)
        d_w = dict(d_w_gate=fill((E, I, H)), d_w_up=fill((E, I, H)), d_w_down=fill((E, H, I)))
        dx, d_weights = self._data_gradient_outputs(x, topk_ids, topk_weights)
        if x.shape[0] == 0:
            for t in d_w.values():
                t.zero_()
        else:
            self._check_status(wait=False)
            entry = "backward_fp8" if a13 is None else "backward_fp8_saved"
            with on_device(x.device):
                env = self._workspace(x.shape[0], x.device, entry, given=() if a13 is None else ("a13",))
                env.update(self._fp8_backward_inputs(dout, x, topk_ids, topk_weights, experts, dx, d_weights), **d_w)
                if a13 is not None:
                    env["a13"] = a13
                self._run_and_report(entry, env, x.device)
        return dict(dx=dx, d_topk_weights=d_weights, **d_w)

    def _data_gradient_outputs(self, x, topk_ids, topk_weights):
        """dx and d_topk_weights to be written: NaN-poisoned in poison mode, but for the pairs
        without a row, whose d_topk_weights is 0 and written by no kernel."""
        if self.poison:
            in_range = (topk_ids >= 0) & (topk_ids < self.spec.experts)
            return torch.full_like(x, float("nan")), torch.where(in_range, float("nan"), 0.0).to(torch.float32)
        return torch.empty_like(x), torch.zeros_like(topk_weights, dtype=torch.float32)

    @staticmethod
    def _fp8_backward_inputs(dout, x, topk_ids, topk_weights, experts, dx, d_weights) -> dict:
        return dict(x=x, dout=dout, topk_ids=topk_ids, topk_weights=topk_weights, dx=dx, d_topk_weights=d_weights,
                    w13_q=experts.gate_up.values, w13_scales=experts.gate_up.scales,
                    w_down_t_q=experts.down_t.values, w_down_t_scales=experts.down_t.scales,
                    w13_t_q=experts.gate_up_t.values, w13_t_scales=experts.gate_up_t.scales)

    @property
    def has_backward(self) -> bool:
        return "backward" in self.plan["steps"] or "backward_recompute" in self.plan["steps"]

    def forward_train(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None,
                      peers=None):
        """(out, *saved): the forward of autograd. saved (saved_names) is what the backward
        needs besides the inputs: the SwiGLU inputs ga = x @ w_gate^T and gb = x @ w_up^T in
        dispatch's row order (expert parallel: in the receive layout, rows bounded by the peer
        workspace's receive bound recv_rows), the shared expert's sa, sb (empty without one),
        and (one GPU) dispatch's tables pos, row_token, tile_expert, counts."""
        tokens = x.shape[0]
        out = torch.empty_like(x)
        with on_device(x.device):
            env = self._workspace(tokens, x.device, "forward_train", peers, keep=True, fresh=self.saved_names)
            # (A missing shared expert's entries are empty tensors, each its own inside a custom
            # op, whose outputs may not alias one another; one, made once, for eager calls.)
            per_call = PER_CALL_MEMORY.get()
            saved = tuple(env[n] if n in env else x.new_empty(0) if per_call else self._empty(x)
                          for n in self.saved_names)
            if tokens == 0 and not self.expert_parallel:  # (a rank without tokens still serves its peers)
                return (out,) + saved
            self._check_status(wait=False)
            env.update(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w_gate=w_gate, w_up=w_up, w_down=w_down,
                       out=out, ws_gate=ws_gate, ws_up=ws_up, ws_down=ws_down)
            self._run_and_report("forward_train", env, x.device, skip=self._token_grids if tokens == 0 else ())
        return (out,) + saved

    def saved_shapes(self, tokens) -> dict:
        """Shapes of forward_train's saved tensors (integer arithmetic only: torch.compile's
        fake implementations call it with symbolic sizes)."""
        rt, c = self.plan["row_tile"], int(self.plan["overrides"].get("cluster_m", 1))
        K, E, I, S = self.spec.topk, self.spec.local_experts, self.spec.intermediate, self.spec.shared_intermediate
        m_tiles = c * ((tokens * K + c * rt - 1) // (c * rt)) + c * E
        rows = m_tiles * rt
        # The row buffers hold the per-GEMM path's rows or, where a band of swapped tiles serves
        # T and lays out more, the band's (the Plan's rows_w), and the tile table covers them.
        params = {k["name"]: k["params"] for k in self.plan["kernels"]}
        for top, entry in self.plan.get("launch_bands", []):
            if tokens <= top:
                n = next((params[k]["tile_m"] for k in self.plan["steps"][entry] if params[k].get("swap")), 0)
                band_rows = ((tokens * K + n - 1) // n + E) * n if n else 0
                if band_rows > rows:
                    rows, m_tiles = band_rows, (band_rows + rt - 1) // rt
                break
        return dict(ga=(rows, I), gb=(rows, I), sa=(tokens, S) if S else (0,), sb=(tokens, S) if S else (0,),
                    pos=(tokens, K), row_token=(rows,), tile_expert=(m_tiles,), counts=(E,))

    def backward(self, dout, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None,
                 saved=None, peers=None):
        """(dx, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down) for
        the output gradient dout (DESIGN.md section 1); the shared expert's are None without
        one. saved: forward_train's saved tensors (a sequence in saved_names order); without
        them the backward dispatches again and recomputes the SwiGLU inputs. Pairs whose id is
        out of range get d_topk_weights 0 and contribute nothing. peers: an expert-parallel
        variant's PeerWorkspace (its backward exchanges the rows again, with or without saved)."""
        if not self.has_backward:
            raise NotImplementedError(f"{self.name}: the backward is not generated for this layer "
                                      f"({self.why_no_backward()})")
        tokens = x.shape[0]
        weights = [w_gate, w_up, w_down] + ([ws_gate, ws_up, ws_down] if self.spec.shared_intermediate else [])
        # Every element of dx and of the weight gradients is written (an expert without tokens
        # gets zeros); d_topk_weights starts at zero for pairs whose id is out of range (empty
        # slots included). The golden tests' poison mode starts all of them at NaN instead, but
        # for those pairs' d_topk_weights entries, which no kernel writes.
        if self.poison:
            dx = torch.full_like(x, float("nan"))
            in_range = (topk_ids >= 0) & (topk_ids < self.spec.experts)
            d_weights = torch.where(in_range, float("nan"), 0.0).to(torch.float32)
            d_w = [torch.full_like(w, float("nan")) for w in weights]
        else:
            dx, d_weights = torch.empty_like(x), torch.zeros_like(topk_weights, dtype=torch.float32)
            d_w = [torch.empty_like(w) for w in weights]
        grads = [dx, d_weights, *d_w] + [None] * (8 - 2 - len(d_w))
        if self.expert_parallel and peers is None:
            raise InputError(f"{self.name} is expert parallel: its backward takes the peer workspace")
        if tokens == 0 and not self.expert_parallel:  # (a rank without tokens still serves its peers)
            for d in d_w:
                d.zero_()
            return tuple(grads)
        self._check_status(wait=False)
        entry = "backward" if saved is not None else "backward_recompute"
        with on_device(x.device):
            if peers is not None and peers.missing(self, entry):
                raise InputError(f"{self.name}: the peer workspace has no backward regions yet; the forward makes "
                                 "them when it runs under autograd (mokgen.moe with tensors that require grad), or "
                                 f"call peers.prepare(variant, {entry!r}) on every rank together first")
            env = self._workspace(tokens, x.device, entry, peers, keep=True)
            env.update(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w_gate=w_gate, w_up=w_up, w_down=w_down,
                       ws_gate=ws_gate, ws_up=ws_up, ws_down=ws_down, dout=dout, dx=dx, d_topk_weights=d_weights)
            env.update(zip(("d_w_gate", "d_w_up", "d_w_down", "d_ws_gate", "d_ws_up", "d_ws_down"), d_w))
            if saved is not None:
                env.update(zip(self.saved_names, saved))
            skip = ()
            if tokens == 0:  # an expert-parallel rank without tokens: its shared expert's gradients are zero
                skip = self._token_grids | {n for n in self.plan["steps"][entry] if "shared" in n}
                for d in d_w[3:]:
                    d.zero_()
            self._run_and_report(entry, env, x.device, skip=skip)
        return tuple(grads)

    def why_no_backward(self) -> str:
        return backward_decision(self.plan)

    def forward_routed(self, x, logits, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
        """(out, topk_ids, topk_weights) from the router logits: one launch (route, dispatch,
        GEMMs, combine) where the Plan has it and T is one the fused launch serves, else the
        route kernel, then forward. Either way the same bits."""
        tokens = x.shape[0]
        if not routes_in_launch(self.plan, tokens):
            ids, weights = self.route(logits)
            return self.forward(x, ids, weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down), ids, weights
        K = self.spec.topk
        out = torch.empty_like(x)
        ids = torch.empty(tokens, K, dtype=torch.int32, device=x.device)
        weights = torch.empty(tokens, K, dtype=torch.float32, device=x.device)
        self._run_forward(routed_entry(self.plan, tokens), x, dict(logits=logits, topk_ids=ids, topk_weights=weights),
                          w_gate, w_up, w_down, ws_gate, ws_up, ws_down, out)
        return out, ids, weights

    def route(self, logits):
        tokens = logits.shape[0]
        K = self.spec.topk
        ids = torch.empty(tokens, K, dtype=torch.int32, device=logits.device)
        weights = torch.empty(tokens, K, dtype=torch.float32, device=logits.device)
        if tokens:
            with on_device(logits.device):
                self.run("route", dict(logits=logits, topk_ids=ids, topk_weights=weights), logits.device)
        return ids, weights

    def route_backward(self, logits, ids, d_weights):
        """d_logits [T, E] fp32 of the route stage (softmax, top-k, renormalisation) from
        d_topk_weights; the ids are the ones route returned for these logits."""
        if "route_backward" not in self.plan["steps"]:
            raise InputError(f"{self.name} was built without the route's backward: rebuild it (`mokgen build` "
                             "or mokgen.load(spec)) to differentiate through mokgen.route")
        d_logits = torch.empty_like(logits)
        if logits.shape[0]:
            with on_device(logits.device):
                self.run("route_backward", dict(logits=logits, topk_ids=ids, d_topk_weights=d_weights.contiguous(),
                                                d_logits=d_logits), logits.device)
        return d_logits
