"""Train a small language model whose MoE blocks run on the generated kernels, beside the
same model on torch ops (same initial parameters, same batches), and compare the loss curves.

    python benchmarks/train_demo.py [--steps 300] [--out bench-out/train] [--dtype fp8]
    torchrun --nproc-per-node=2 benchmarks/train_demo.py     # expert parallel over 2 GPUs

--dtype fp8: the MoE blocks are mokgen.MoE(dtype="fp8") (the FP8 experts over bf16 master
weights, every gradient in FP8), beside the same model on torch bf16 ops.

Expert parallel (under torchrun): every rank holds E/W experts of each MoE block and trains
on its own batches (the same chain); the replicated parameters' gradients are averaged over
the ranks, the experts' divided by W (the loss is the ranks' mean); the torch model runs
the same blocks with the torch expert-parallel layer (NCCL all_to_all).

The data is a synthetic Markov chain over a small vocabulary (each token has a few likely
successors), so the loss has somewhere to go. Writes train.json (both loss curves and the
comparison) and, with matplotlib, train.png. Exits 1 when the curves disagree: the final
losses (mean of the last 20 steps) more than 2% apart, or any step's losses more than 0.1 apart.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mokgen

# The layer of the golden tests' "small and odd" shape (built by build_gpu_variants.py).
EXPERTS, TOPK, HIDDEN, INTER = 40, 6, 1536, 640
VOCAB, SEQ, BATCH, LAYERS = 512, 256, 16, 2


class RMSNorm(nn.Module):
    def __init__(self, dim, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(x.dtype)


class TinyMoELM(nn.Module):
    """Embedding -> LAYERS x (x + MoE(norm(x))) -> norm -> head."""

    def __init__(self, reference: bool, device, group=None, dtype="bf16"):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN, device=device, dtype=torch.bfloat16)
        self.norms = nn.ModuleList(RMSNorm(HIDDEN, device) for _ in range(LAYERS))
        self.moes = nn.ModuleList(mokgen.MoE(HIDDEN, INTER, EXPERTS, TOPK, renormalize=True, device=device,
                                             reference=reference, group=group, dtype=dtype) for _ in range(LAYERS))
        self.final = RMSNorm(HIDDEN, device)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False, device=device, dtype=torch.bfloat16)

    def forward(self, tokens):
        x = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(self.final(x)).float()


def markov_batches(steps, device, seed=0, stream=None):
    """Batches of (input, target) token sequences from a fixed random chain with 4 likely
    successors per token; stream: a seed of their own for the sequences (one per rank)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    succ = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    if stream is not None:
        g = torch.Generator(device="cpu").manual_seed(stream)
    for _ in range(steps):
        seq = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        choice = torch.randint(0, 4, (BATCH, SEQ), generator=g)
        noise = torch.rand(BATCH, SEQ, generator=g) < 0.1
        rand_tok = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        for t in range(SEQ):
            nxt = succ[seq[:, t], choice[:, t]]
            seq[:, t + 1] = torch.where(noise[:, t], rand_tok[:, t], nxt)
        seq = seq.to(device)
        yield seq[:, :-1], seq[:, 1:]


def train(model, steps, device, log_every, name, group=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    t0 = time.time()
    rank = dist.get_rank(group) if group is not None else 0
    for step, (inp, tgt) in enumerate(markov_batches(steps, device, stream=None if group is None else 1000 + rank)):
        loss = F.cross_entropy(model(inp).reshape(-1, VOCAB), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if group is not None:
            sync_gradients(model, group)
            loss = loss.detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
        opt.step()
        losses.append(loss.item())
        if rank == 0 and (step % log_every == 0 or step == steps - 1):
            print(f"  {name} step {step:4d}: loss {losses[-1]:.4f} ({time.time() - t0:.1f} s)", flush=True)
    return losses


def expert_parameters(model) -> set:
    return {id(p) for m in model.moes for p in (m.w_gate, m.w_up, m.w_down)}


def sync_gradients(model, group):
    """The gradients of the ranks' mean loss: replicated parameters averaged over the ranks,
    each rank's own experts (which saw every rank's tokens) divided by the world size."""
    experts, world = expert_parameters(model), dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) in experts:
            p.grad.div_(world)
        else:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)


@torch.no_grad()
def init_experts(model, group):
    """Rank r's experts are rows r*E/W ... of one global draw (the same on every rank)."""
    g = torch.Generator(device="cpu").manual_seed(7)
    rank = dist.get_rank(group)
    for m in model.moes:
        for p, fan_in in ((m.w_gate, HIDDEN), (m.w_up, HIDDEN), (m.w_down, INTER)):
            full = torch.randn((EXPERTS,) + tuple(p.shape[1:]), generator=g) / fan_in ** 0.5
            p.copy_(full[rank * p.shape[0]:(rank + 1) * p.shape[0]])


def plot(curves: dict, world: int, path: Path, dtype: str = "bf16") -> None:
    """Both loss curves (train.json's "curves") as a PNG, where matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, v in curves.items():
        ax.plot(v, label=k, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(f"Tiny MoE LM, mokgen vs torch: {LAYERS} layers of E{EXPERTS} K{TOPK} H{HIDDEN} I{INTER}"
                 + (f"\nexpert parallel over {world} GPUs" if world > 1 else "")
                 + ("\nmokgen's experts in FP8, torch's in bf16" if dtype == "fp8" else ""), fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path("bench-out/train"))
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--plot", type=Path, default=None, help="only redraw train.png from this train.json")
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="the mokgen model's experts (torch's: bf16)")
    args = ap.parse_args()
    if args.plot:
        data = json.loads(args.plot.read_text())
        return plot(data["curves"], data["summary"].get("world_size", 1), args.plot.with_name("train.png"),
                    data["summary"].get("dtype", "bf16"))
    if not torch.cuda.is_available():
        sys.exit("train_demo needs a CUDA GPU")
    group, rank, world = None, 0, int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if args.dtype == "fp8":
            sys.exit("--dtype fp8 runs on one GPU (mokgen.MoE(dtype='fp8') is not expert parallel)")
        from mokgen.verify_ranks import init_ranks

        rank, _ = init_ranks()
        group = dist.group.WORLD
    device = "cuda"
    torch.manual_seed(0)
    ours = TinyMoELM(reference=False, device=device, group=group, dtype=args.dtype)
    if group is not None:
        init_experts(ours, group)
    ref = TinyMoELM(reference=True, device=device, group=group)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    if rank == 0:
        print(f"{BATCH}x{SEQ} tokens per step{f' per rank, {world} ranks (expert parallel)' if group else ''}, "
              f"{LAYERS} MoE layers E{EXPERTS} K{TOPK} H{HIDDEN} I{INTER}"
              f"{', mokgen experts in FP8' if args.dtype == 'fp8' else ''}", flush=True)
    curves = {"mokgen": train(ours, args.steps, device, args.log_every, "mokgen", group),
              "torch": train(ref, args.steps, device, args.log_every, "torch", group)}
    if rank != 0:
        dist.destroy_process_group()
        return
    a, b = curves["mokgen"], curves["torch"]
    tail = min(20, len(a))
    final = (sum(a[-tail:]) / tail, sum(b[-tail:]) / tail)
    worst_step = max(abs(x - y) for x, y in zip(a, b))
    ok = abs(final[0] - final[1]) <= 0.02 * final[1] and worst_step <= 0.1
    summary = dict(steps=args.steps, world_size=world, dtype=args.dtype, first_loss=(a[0], b[0]), final_loss=final,
                   max_step_difference=worst_step, agree=ok)
    print(f"first loss {a[0]:.4f} / {b[0]:.4f}, final (mean of last {tail}) {final[0]:.4f} / {final[1]:.4f} "
          f"(mokgen / torch), largest per-step difference {worst_step:.4f}: {'agree' if ok else 'DISAGREE'}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.json").write_text(json.dumps(dict(summary=summary, curves=curves), indent=1))
    plot(curves, world, args.out / "train.png", args.dtype)
    if group is not None:
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
