"""MoESpec: the user's description of one MoE layer, validated.

Every illegal value is refused with a one-line message that names the field and
says what would be legal. The spec is pure data: no torch, no cutlass.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

# bf16; fp8: e4m3 values with fp32 block scales (activations 1 x 128, weights 128 x 128),
# BF16 outputs and gradients (mokgen/fp8.py, docs/fp8.md)
DTYPES = ("bf16", "fp8")
FP8_BLOCK = 128  # fp8: the scale block; hidden and intermediate sizes must be multiples of it
E4M3_MAX = 448.0  # fp8: the largest finite e4m3 value (a block's amax maps to it)
# fp8: w_gate and w_up are stored interleaved per this many rows, so one 128-row block of the
# stored matrix (one GEMM tile, one scale block) holds both inputs of 64 columns of SwiGLU
FP8_INTERLEAVE = FP8_BLOCK // 2
ARCHS = ("sm_90a",)
TOPOLOGIES = ("single", "nvlink")
# The grouped GEMMs load K in 64-element (128-byte) steps and the dispatch and
# combine move 8 elements (16 bytes) per thread: sizes must be multiples of this.
SIZE_MULTIPLE = 64
MAX_TOPK = 64
MAX_EXPERTS = 4096
MAX_SIZE = 65536


class SpecError(ValueError):
    """An illegal MoESpec value; the message is one line, fit for a CLI."""


@dataclass(frozen=True)
class MoESpec:
    experts: int
    topk: int
    hidden: int
    intermediate: int
    shared_intermediate: int = 0  # 0: no shared expert
    dtype: str = "bf16"
    world_size: int = 1
    topology: str = "single"
    arch: str = "sm_90a"
    renormalize: bool = False  # router: renormalise the top-k weights to sum to 1
    # Nodes the world_size GPUs are in (node-major ranks: rank = node * gpus_per_node + local
    # index). Inside a node the GPUs are linked by `topology`; between nodes the tokens go
    # through a distributed engine (NCCL through torch.distributed), mokgen/schedule/multinode.py.
    nodes: int = 1

    def __post_init__(self):
        validate(self)

    # ---- derived ----------------------------------------------------------------
    @property
    def local_experts(self) -> int:
        return self.experts // self.world_size

    @property
    def gpus_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def node_experts(self) -> int:
        """Experts per node (a token's rows cross the network once per node they go to)."""
        return self.experts // self.nodes

    @property
    def variant(self) -> str:
        """A readable name that identifies the generated code for this spec."""
        parts = [f"e{self.experts}", f"k{self.topk}", f"h{self.hidden}", f"i{self.intermediate}"]
        if self.shared_intermediate:
            parts.append(f"s{self.shared_intermediate}")
        parts.append(self.dtype)
        if self.world_size > 1:
            parts.append(f"w{self.world_size}{self.topology}")
        if self.nodes > 1:
            parts.append(f"n{self.nodes}")
        if self.renormalize:
            parts.append("rn")
        parts.append(self.arch.replace("_", ""))
        return "_".join(parts)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["nodes"] == 1:  # (one node: the spec reads, and its variants stay, as before nodes existed)
            del d["nodes"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MoESpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpecError(f"unknown spec field(s): {', '.join(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _int(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise SpecError(f"{name} must be in [{lo}, {hi}], got {value}")


def _size(name: str, value, allow_zero: bool = False) -> None:
    _int(name, value, 0 if allow_zero else SIZE_MULTIPLE, MAX_SIZE)
    if value % SIZE_MULTIPLE:
        raise SpecError(
            f"{name}={value} is not a multiple of {SIZE_MULTIPLE}: the GEMM tiles load "
            f"{SIZE_MULTIPLE}-element K steps (try {value - value % SIZE_MULTIPLE or SIZE_MULTIPLE} "
            f"or {value + SIZE_MULTIPLE - value % SIZE_MULTIPLE})"
        )


def validate(s: MoESpec) -> None:
    _int("experts", s.experts, 1, MAX_EXPERTS)
    _int("topk", s.topk, 1, MAX_TOPK)
    if s.topk > s.experts:
        raise SpecError(f"topk={s.topk} exceeds experts={s.experts}: a token cannot pick more experts than exist")
    _size("hidden", s.hidden)
    _size("intermediate", s.intermediate)
    _size("shared_intermediate", s.shared_intermediate, allow_zero=True)
    if s.dtype not in DTYPES:
        raise SpecError(f"unknown dtype {s.dtype!r}; supported: {', '.join(DTYPES)}")
    if s.dtype == "fp8":
        for name in ("hidden", "intermediate", "shared_intermediate"):
            if getattr(s, name) % FP8_BLOCK:
                raise SpecError(f"{name}={getattr(s, name)} is not a multiple of {FP8_BLOCK}: fp8 scales cover "
                                f"{FP8_BLOCK}-wide blocks of K")
    if s.arch not in ARCHS:
        raise SpecError(f"unknown or unsupported arch {s.arch!r}; supported: {', '.join(ARCHS)}")
    if s.topology not in TOPOLOGIES:
        raise SpecError(f"unknown topology {s.topology!r}; supported: {', '.join(TOPOLOGIES)}")
    _int("world_size", s.world_size, 1, 1024)
    if s.world_size == 1 and s.topology != "single":
        raise SpecError(f"topology {s.topology!r} needs world_size > 1; use topology 'single' for one GPU")
    if s.world_size > 1 and s.topology == "single":
        raise SpecError(f"world_size={s.world_size} needs a multi-GPU topology such as 'nvlink'")
    if s.experts % s.world_size:
        raise SpecError(
            f"experts={s.experts} is not divisible by world_size={s.world_size}: each GPU must own the same number of experts"
        )
    _int("nodes", s.nodes, 1, 1024)
    if s.world_size % s.nodes:
        raise SpecError(f"world_size={s.world_size} is not divisible by nodes={s.nodes}: every node must hold the "
                        "same number of GPUs")
    if s.nodes > 1 and s.shared_intermediate:
        raise SpecError("a shared expert is not generated across nodes yet (nodes > 1 needs shared_intermediate=0)")
    if not isinstance(s.renormalize, bool):
        raise SpecError(f"renormalize must be true or false, got {s.renormalize!r}")


# Named layers users ask for by name. Sizes are the published model configs.
PRESETS: dict[str, MoESpec] = {
    "olmoe": MoESpec(experts=64, topk=8, hidden=2048, intermediate=1024),
    "qwen3-30b-a3b": MoESpec(experts=128, topk=8, hidden=2048, intermediate=768, renormalize=True),
    "deepseek-v3": MoESpec(experts=256, topk=8, hidden=7168, intermediate=2048, shared_intermediate=2048,
                           renormalize=True),
    "mixtral-8x7b": MoESpec(experts=8, topk=2, hidden=4096, intermediate=14336, renormalize=True),
    "deepseek-v2-lite": MoESpec(experts=64, topk=6, hidden=2048, intermediate=1408, shared_intermediate=2816),
}
DEFAULT_PRESET = "olmoe"
