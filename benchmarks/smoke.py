"""Quick end-to-end smoke on a GPU: one small forward of the default variant, error printed."""
import math
import sys

import torch

import mokgen
from mokgen.reference import moe_reference, rel_error

E, K, H, I = 64, 8, 2048, 1024
for T in (int(a) for a in (sys.argv[1:] or ["7", "1000"])):
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1), K)
    w = (w / w.sum(-1, keepdim=True)).float()
    wg = (torch.randn(E, I, H, device="cuda", generator=g) / math.sqrt(H)).bfloat16()
    wu = (torch.randn(E, I, H, device="cuda", generator=g) / math.sqrt(H)).bfloat16()
    wd = (torch.randn(E, H, I, device="cuda", generator=g) / math.sqrt(I)).bfloat16()
    v = mokgen.load(mokgen.MoESpec(experts=E, topk=K, hidden=H, intermediate=I))
    v.poison = True
    env_out = v.forward(x, ids.int(), w, wg, wu, wd)
    torch.cuda.synchronize()
    print(f"T={T} rel_err={rel_error(env_out, moe_reference(x, ids, w, wg, wu, wd)):.3e} "
          f"nan={torch.isnan(env_out).any().item()}", flush=True)
