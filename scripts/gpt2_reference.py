#!/usr/bin/env python3
"""The PyTorch side of scripts/gpu-check.sh: the built-in GPT's architecture (Shoal's `models.rs`: learned token
and position embeddings, pre-norm blocks of causal multi-head attention with a fused q|k|v projection and a GELU
MLP of 4x the width, a final layer norm, an untied head with bias) at GPT-2 small's shape, trained in PyTorch
eager with bf16 autocast (f32 master weights) and AdamW, on random byte tokens. Prints one JSON line: tokens/s
(median step after warm-up), step times, and the model FLOP utilisation against the bf16 peak.

    python3 scripts/gpt2_reference.py --steps 20 --batch 8 --peak-tflops 790
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width, eps=1e-5)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width, eps=1e-5)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x, mask):
        b, t, w = x.shape
        hd = w // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        # Written out as Shoal's model computes it (no fused attention kernel): scores, mask, softmax, product.
        att = (q @ k.transpose(-2, -1)).float() / math.sqrt(hd)
        att = att.masked_fill(~mask[:t, :t], float("-inf")).softmax(-1).to(v.dtype)
        y = (att @ v).transpose(1, 2).reshape(b, t, w)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, context, layers, heads, width):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, eps=1e-5)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", torch.tril(torch.ones(context, context, dtype=torch.bool)), persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.tok(ids) + self.pos[:t]
        for blk in self.blocks:
            x = blk(x, self.mask)
        return self.head(self.ln_f(x)).float()


def model_flops_per_token(n_params_no_emb, layers, width, context):
    """Training FLOPs per token: 6N for the matrices plus attention's 12·L·T·d (PaLM's appendix B)."""
    return 6 * n_params_no_emb + 12 * layers * context * width


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = Gpt(a.vocab, a.context, a.layers, a.heads, a.width).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.tok.weight.numel() + model.pos.numel()
    times, losses = [], []
    for step in range(a.steps):
        ids = torch.randint(0, 256, (a.batch, a.context + 1), device=dev)
        x, y = ids[:, :-1], ids[:, 1:]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.view(-1, a.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    steady = times[a.warmup:] or times
    step_s = statistics.median(steady)
    tokens = a.batch * a.context
    tok_s = tokens / step_s
    fpt = model_flops_per_token(n_params - n_emb, a.layers, a.width, a.context)
    print(json.dumps({
        "impl": "pytorch-eager-bf16-autocast",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "params": n_params,
        "tokens_per_step": tokens,
        "step_s_median": step_s,
        "tokens_per_s": tok_s,
        "flops_per_token": fpt,
        "mfu": tok_s * fpt / (a.peak_tflops * 1e12),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }))


if __name__ == "__main__":
    main()
