"""Train a small language model whose MoE blocks run on the generated kernels, beside the
same model on torch ops (same initial parameters, same batches), and compare the loss curves.

    python benchmarks/train_demo.py [--steps 300] [--out bench-out/train]

The data is a synthetic Markov chain over a small vocabulary (each token has a few likely
successors), so the loss has somewhere to go. Writes train.json (both loss curves and the
comparison) and, with matplotlib, train.png. Exits 1 when the curves disagree: the final
losses (mean of the last 20 steps) more than 2% apart, or any step's losses more than 0.1 apart.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
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

    def __init__(self, reference: bool, device):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN, device=device, dtype=torch.bfloat16)
        self.norms = nn.ModuleList(RMSNorm(HIDDEN, device) for _ in range(LAYERS))
        self.moes = nn.ModuleList(mokgen.MoE(HIDDEN, INTER, EXPERTS, TOPK, renormalize=True, device=device,
                                             reference=reference) for _ in range(LAYERS))
        self.final = RMSNorm(HIDDEN, device)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False, device=device, dtype=torch.bfloat16)

    def forward(self, tokens):
        x = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(self.final(x)).float()


def markov_batches(steps, device, seed=0):
    """Batches of (input, target) token sequences from a fixed random chain with 4 likely successors per token."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    succ = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
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


def train(model, steps, device, log_every, name):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    t0 = time.time()
    for step, (inp, tgt) in enumerate(markov_batches(steps, device)):
        loss = F.cross_entropy(model(inp).reshape(-1, VOCAB), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            print(f"  {name} step {step:4d}: loss {losses[-1]:.4f} ({time.time() - t0:.1f} s)", flush=True)
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path("bench-out/train"))
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("train_demo needs a CUDA GPU")
    device = "cuda"
    torch.manual_seed(0)
    ours = TinyMoELM(reference=False, device=device)
    ref = TinyMoELM(reference=True, device=device)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    print(f"{BATCH}x{SEQ} tokens per step, {LAYERS} MoE layers E{EXPERTS} K{TOPK} H{HIDDEN} I{INTER}", flush=True)
    curves = {"mokgen": train(ours, args.steps, device, args.log_every, "mokgen"),
              "torch": train(ref, args.steps, device, args.log_every, "torch")}
    a, b = curves["mokgen"], curves["torch"]
    tail = min(20, len(a))
    final = (sum(a[-tail:]) / tail, sum(b[-tail:]) / tail)
    worst_step = max(abs(x - y) for x, y in zip(a, b))
    ok = abs(final[0] - final[1]) <= 0.02 * final[1] and worst_step <= 0.1
    summary = dict(steps=args.steps, first_loss=(a[0], b[0]), final_loss=final, max_step_difference=worst_step,
                   agree=ok)
    print(f"first loss {a[0]:.4f} / {b[0]:.4f}, final (mean of last {tail}) {final[0]:.4f} / {final[1]:.4f} "
          f"(mokgen / torch), largest per-step difference {worst_step:.4f}: {'agree' if ok else 'DISAGREE'}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.json").write_text(json.dumps(dict(summary=summary, curves=curves), indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for k, v in curves.items():
            ax.plot(v, label=k, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy loss")
        ax.set_title(f"Tiny MoE LM ({LAYERS} layers of E{EXPERTS} K{TOPK} H{HIDDEN} I{INTER}): mokgen vs torch")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.out / "train.png", dpi=110)
        print(f"wrote {args.out / 'train.png'}")
    except ImportError:
        print("matplotlib not installed: no plot")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
