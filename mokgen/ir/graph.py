"""The stage graph of one MoE layer: what is computed, with symbolic shapes.

The token count T stays a sympy symbol, so one graph (and one build) serves every
batch size. Stages name their input and output tensors; a tensor is either a graph
input or the output of an earlier stage. No tiling, no hardware: that is the
scheduler's business.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from .spec import MoESpec

T = sympy.Symbol("T", integer=True, nonnegative=True)
# Expert parallelism: the tokens per rank a peer workspace holds (what a rank may receive
# depends on every rank's T, so buffers that receive are sized from this bound, not from T).
C = sympy.Symbol("C", integer=True, positive=True)
# ... and the (token, expert) rows one rank may receive in a call: every rank's C*K pairs could
# go to one rank (the default bound, which never overflows); a smaller bound saves memory and
# a call that would exceed it is refused on the device.
RC = sympy.Symbol("RC", integer=True, positive=True)


@dataclass(frozen=True)
class TensorType:
    name: str
    shape: tuple  # ints and sympy expressions of T
    dtype: str  # "bf16" | "f32" | "i32"

    def numel(self):
        return sympy.prod(self.shape)

    def describe(self) -> str:
        return f"{self.name}[{', '.join(str(d) for d in self.shape)}]:{self.dtype}"


@dataclass(frozen=True)
class Stage:
    name: str
    kind: str  # "route" | "send" | "gemm" | "reduce"
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    flops: object = 0  # sympy expression of T
    attrs: dict = field(default_factory=dict)


@dataclass
class Graph:
    spec: MoESpec
    tensors: dict[str, TensorType]
    stages: list[Stage]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def has(self, name: str) -> bool:
        return any(s.name == name for s in self.stages)

    def flops(self, routed_only: bool = True):
        kinds = [s for s in self.stages if s.kind == "gemm" and (not routed_only or s.attrs.get("routed"))]
        return sympy.expand(sum((s.flops for s in kinds), sympy.Integer(0)))

    def check(self) -> None:
        """Every stage reads only graph inputs or earlier outputs; every output is produced."""
        known = set(self.inputs)
        for s in self.stages:
            missing = [t for t in s.inputs if t not in known]
            if missing:
                raise ValueError(f"stage {s.name} reads {missing} before anything produces them")
            known.update(s.outputs)
        for o in self.outputs:
            if o not in known:
                raise ValueError(f"graph output {o} is never produced")


def layer_inputs(spec: MoESpec) -> list[TensorType]:
    """The routed layer's inputs (DESIGN.md section 1), and dispatch's positions and rows,
    which the forward and the backward graphs share."""
    E, K, H, I = spec.local_experts, spec.topk, spec.hidden, spec.intermediate
    return [
        TensorType("x", (T, H), "bf16"),
        TensorType("topk_ids", (T, K), "i32"),
        TensorType("topk_weights", (T, K), "f32"),
        TensorType("w_gate", (E, I, H), "bf16"),
        TensorType("w_up", (E, I, H), "bf16"),
        TensorType("w_down", (E, H, I), "bf16"),
        TensorType("pos", (T, K), "i32"),
        TensorType("xs", (T * K, H), "bf16"),
    ]


def forward_graph(spec: MoESpec, fused_route: bool = False) -> Graph:
    """The forward layer of DESIGN.md section 1 as stages.

    route (optional)  logits -> topk_ids, topk_weights
    send              x, topk_ids -> xs (rows grouped by expert), pos
    gemm_gateup       xs -> h = silu(xs @ w_gate^T) * (xs @ w_up^T)
    gemm_down         h -> y = h @ w_down^T
    shared_* (opt.)   x -> hs -> ys, the dense shared expert
    reduce            out = bf16(sum_k w[t,k] * y[pos[t,k]] + ys[t])

    Expert parallel (world_size W > 1, E/W experts per rank): send groups the rank's rows
    by global expert; send_peers moves each row to the rank owning its expert (xr, grouped
    by local expert, then source rank); the GEMMs run on xr; return moves each result row
    back to the rank its token lives on (y, in send's order); reduce as above.
    """
    K, H, I, S = spec.topk, spec.hidden, spec.intermediate, spec.shared_intermediate
    R = T * K  # routed (token, slot) rows
    tensors = layer_inputs(spec) + [
        TensorType("h", (R, I), "bf16"),
        TensorType("y", (R, H), "bf16"),
        TensorType("out", (T, H), "bf16"),
    ]
    inputs = ["x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down"]
    stages: list[Stage] = []
    if fused_route:
        tensors.append(TensorType("logits", (T, spec.experts), "f32"))
        inputs = ["x", "logits", "w_gate", "w_up", "w_down"]
        stages.append(Stage("route", "route", ("logits",), ("topk_ids", "topk_weights"),
                            attrs={"renormalize": spec.renormalize}))
    stages.append(Stage("send", "send", ("x", "topk_ids"), ("xs", "pos")))
    a, c = "xs", "y"
    if spec.world_size > 1:  # rows received from every rank: bounded by W * C * K
        tensors += [TensorType("xr", (spec.world_size * C * K, H), "bf16"),
                    TensorType("yr", (spec.world_size * C * K, H), "bf16")]
        stages.append(Stage("send_peers", "send", ("xs",), ("xr",), attrs={"link": spec.topology}))
        a, c = "xr", "yr"
    stages += [
        Stage("gemm_gateup", "gemm", (a, "w_gate", "w_up"), ("h",), flops=4 * R * H * I,
              attrs={"epilogue": "swiglu", "routed": True}),
        Stage("gemm_down", "gemm", ("h", "w_down"), (c,), flops=2 * R * I * H,
              attrs={"epilogue": "store", "routed": True}),
    ]
    if spec.world_size > 1:
        stages.append(Stage("return", "send", ("yr",), ("y",), attrs={"link": spec.topology}))
    reduce_inputs = ["y", "pos", "topk_ids", "topk_weights"]
    if S:
        tensors += [
            TensorType("ws_gate", (S, H), "bf16"),
            TensorType("ws_up", (S, H), "bf16"),
            TensorType("ws_down", (H, S), "bf16"),
            TensorType("hs", (T, S), "bf16"),
            TensorType("ys", (T, H), "bf16"),
        ]
        inputs += ["ws_gate", "ws_up", "ws_down"]
        stages += [
            Stage("shared_gateup", "gemm", ("x", "ws_gate", "ws_up"), ("hs",), flops=4 * T * H * S,
                  attrs={"epilogue": "swiglu", "routed": False}),
            Stage("shared_down", "gemm", ("hs", "ws_down"), ("ys",), flops=2 * T * S * H,
                  attrs={"epilogue": "store", "routed": False}),
        ]
        reduce_inputs.append("ys")
    stages.append(Stage("reduce", "reduce", tuple(reduce_inputs), ("out",),
                        attrs={"order": "k ascending, then shared expert"}))
    g = Graph(spec, {t.name: t for t in tensors}, stages, tuple(inputs), ("out",) if not fused_route
              else ("out", "topk_ids", "topk_weights"))
    g.check()
    return g


def backward_graph(spec: MoESpec, fused_route: bool = False) -> Graph:
    """The backward of the routed layer (DESIGN.md section 1) as stages. It saves nothing
    but the forward's inputs: dispatch runs again (cheap, and the same positions), and the
    SwiGLU inputs are recomputed by one gate/up GEMM that stores both products.

    send              topk_ids -> pos (rows grouped by expert, as in the forward)
    recompute         xs -> ga = xs @ w_gate^T, gb = xs @ w_up^T
    dgrad_down        dout rows -> g = dout[t] @ w_down[e]            (unweighted)
    swiglu_backward   g, ga, gb -> d_topk_weights[t,k] = <g, silu(ga) * gb>,
                      da = w g gb silu'(ga), db = w g silu(ga), hw = w silu(ga) gb
    dgrad_gateup      da, db -> dxs = da @ w_gate[e] + db @ w_up[e]
    reduce            dx[t] = sum_k dxs[pos[t,k]] (k ascending)
    wgrad_*           d_w_down[e] = dout_e^T hw_e, d_w_gate[e] = da_e^T xs_e, d_w_up[e] = db_e^T xs_e
                      (dout_e gathered by wgrad_down; xs, x in dispatch order, is copied by
                      dgrad_gateup's idle warps beside its MMAs)
    route_backward    (fused_route) d_topk_weights, logits, topk_ids -> d_logits: the softmax
                      (and renormalisation) backward of the route stage
    shared_* (opt.)   the same for the shared expert over all T tokens (no weights, no
                      dispatch): its dgrad of down, SwiGLU backward, dgrad of gate/up (added
                      into dx by reduce) and weight gradients
    """
    E, K, H, I, S = spec.local_experts, spec.topk, spec.hidden, spec.intermediate, spec.shared_intermediate
    R = T * K
    tensors = layer_inputs(spec) + [
        TensorType("dout", (T, H), "bf16"),
        TensorType("ga", (R, I), "bf16"),
        TensorType("gb", (R, I), "bf16"),
        TensorType("g", (R, I), "bf16"),
        TensorType("da", (R, I), "bf16"),
        TensorType("db", (R, I), "bf16"),
        TensorType("hw", (R, I), "bf16"),
        TensorType("dxs", (R, H), "bf16"),
        TensorType("dx", (T, H), "bf16"),
        TensorType("d_topk_weights", (T, K), "f32"),
        TensorType("d_w_gate", (E, I, H), "bf16"),
        TensorType("d_w_up", (E, I, H), "bf16"),
        TensorType("d_w_down", (E, H, I), "bf16"),
    ]
    inputs = ["x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down", "dout"]
    outputs = ["dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"]
    routed = {"routed": True}
    stages = [
        Stage("send", "send", ("x", "topk_ids"), ("xs", "pos")),
        Stage("recompute", "gemm", ("xs", "w_gate", "w_up"), ("ga", "gb"), flops=4 * R * H * I,
              attrs={"epilogue": "pair", **routed}),
        Stage("dgrad_down", "gemm", ("dout", "pos", "w_down"), ("g",), flops=2 * R * H * I,
              attrs={"epilogue": "store", **routed}),
        Stage("swiglu_backward", "elementwise", ("g", "ga", "gb", "topk_weights", "pos"),
              ("da", "db", "hw", "d_topk_weights")),
        Stage("dgrad_gateup", "gemm", ("da", "db", "w_gate", "w_up"), ("dxs",), flops=4 * R * H * I,
              attrs={"epilogue": "store", **routed}),
        Stage("reduce", "reduce", ("dxs", "pos", "topk_ids") + (("dx_shared",) if S else ()), ("dx",),
              attrs={"order": "k ascending" + (", then the shared expert" if S else "")}),
        Stage("wgrad_down", "gemm", ("dout", "pos", "hw"), ("d_w_down",), flops=2 * R * H * I,
              attrs={"epilogue": "store", **routed}),
        Stage("wgrad_gate", "gemm", ("da", "xs"), ("d_w_gate",), flops=2 * R * H * I,
              attrs={"epilogue": "store", **routed}),
        Stage("wgrad_up", "gemm", ("db", "xs"), ("d_w_up",), flops=2 * R * H * I,
              attrs={"epilogue": "store", **routed}),
    ]
    if S:
        tensors += [TensorType(n, shape, "bf16") for n, shape in (
            ("ws_gate", (S, H)), ("ws_up", (S, H)), ("ws_down", (H, S)), ("sa", (T, S)), ("sb", (T, S)),
            ("gs", (T, S)), ("das", (T, S)), ("dbs", (T, S)), ("hsb", (T, S)), ("dx_shared", (T, H)),
            ("d_ws_gate", (S, H)), ("d_ws_up", (S, H)), ("d_ws_down", (H, S)))]
        inputs += ["ws_gate", "ws_up", "ws_down"]
        outputs += ["d_ws_gate", "d_ws_up", "d_ws_down"]
        shared = {"routed": False}
        stages[5:5] = [  # before reduce, which adds dx_shared
            Stage("shared_recompute", "gemm", ("x", "ws_gate", "ws_up"), ("sa", "sb"), flops=4 * T * H * S,
                  attrs={"epilogue": "pair", **shared}),
            Stage("shared_dgrad_down", "gemm", ("dout", "ws_down"), ("gs",), flops=2 * T * H * S,
                  attrs={"epilogue": "store", **shared}),
            Stage("shared_swiglu_backward", "elementwise", ("gs", "sa", "sb"), ("das", "dbs", "hsb")),
            Stage("shared_dgrad_gateup", "gemm", ("das", "dbs", "ws_gate", "ws_up"), ("dx_shared",),
                  flops=4 * T * H * S, attrs={"epilogue": "store", **shared}),
        ]
        stages += [Stage(f"wgrad_shared_{n}", "gemm", (a, b), (f"d_ws_{n}",), flops=2 * T * H * S,
                         attrs={"epilogue": "store", **shared})
                   for n, a, b in (("down", "dout", "hsb"), ("gate", "das", "x"), ("up", "dbs", "x"))]
    if fused_route:  # the route stage's gradient: the router's weight gets it through d_logits
        tensors += [TensorType("logits", (T, spec.experts), "f32"), TensorType("d_logits", (T, spec.experts), "f32")]
        inputs.append("logits")
        outputs.append("d_logits")
        stages.append(Stage("route_backward", "route", ("d_topk_weights", "logits", "topk_ids"), ("d_logits",),
                            attrs={"renormalize": spec.renormalize}))
    g = Graph(spec, {t.name: t for t in tensors}, stages, tuple(inputs), tuple(outputs))
    g.check()
    return g
