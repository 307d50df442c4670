"""A GPT-2 124M training step in PyTorch on one GPU, eager and `torch.compile`, in tokens per
second, for comparison with `examples/bench_gpu_gpt2.rs` in the same run
(`benches/gpu/run.sh`). The same model as examples/common/gpt.rs at GPT-2 small's sizes:
12 pre-LayerNorm blocks, d_model 768, 12 heads, context 1024, vocabulary 50257, learned
token and position embeddings, Q/K/V projections (one packed projection with `--attention
sdpa`, as regflow's fused attention has, three with `composed`), scaled scores plus an additive
causal mask (0 / -1e9), the tanh-approximated GELU, a final LayerNorm and logits from the
tied token embedding; AdamW (lr 6e-4, weight decay 0.1), gradients clipped to norm 1.

    python3 benches/peers/gpt2_torch.py [--batch 8] [--steps 20] [--dtypes f32,bf16] [--modes eager,compile]
        [--size gpt2|tiny] [--attention composed,sdpa]

`--attention sdpa` runs each block's attention as `F.scaled_dot_product_attention(...,
is_causal=True)` (flash attention where the GPU and dtype allow), the peer of regflow's
`--attention fused`; `composed` (the default) is the products around a masked softmax.

f32 runs with TF32 off (regflow's f32 products do not use TF32); bf16 is autocast with f32
master weights, as `Graph::mixed_precision(Bf16)` compiles it.
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

SIZES = {"gpt2": (12, 768, 12, 1024, 3072, 50257), "tiny": (2, 64, 4, 64, 256, 65)}


class Block(torch.nn.Module):
    def __init__(self, d, heads, mlp, layers, sdpa=False):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        if sdpa:
            # One projection to q, k and v side by side (nanoGPT's `c_attn`).
            self.qkv = torch.nn.Linear(d, 3 * d)
        else:
            self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.o = torch.nn.Linear(d, d)
        self.fc, self.proj = torch.nn.Linear(d, mlp), torch.nn.Linear(mlp, d)
        for lin in (self.o, self.proj):
            torch.nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, x, mask):
        b, t, d = x.shape
        h = self.ln1(x)
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        if self.sdpa:
            q, k, v = (split(part) for part in self.qkv(h).split(d, dim=2))
        else:
            q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        if self.sdpa:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(d // self.heads)) + mask
            attended = scores.softmax(-1) @ v
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(torch.nn.Module):
    def __init__(self, layers, d, heads, t, mlp, vocab, sdpa=False):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(t, d)
        torch.nn.init.normal_(self.wte.weight, std=0.02)
        torch.nn.init.normal_(self.wpe.weight, std=0.01)
        self.blocks = torch.nn.ModuleList(Block(d, heads, mlp, layers, sdpa) for _ in range(layers))
        self.lnf = torch.nn.LayerNorm(d)

    def forward(self, ids, targets, mask):
        x = self.wte(ids) + self.wpe.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x, mask)
        logits = self.lnf(x) @ self.wte.weight.T
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets)


def tokens_per_second(model, step_fn, args, t, vocab):
    gen = torch.Generator(device="cuda").manual_seed(0)
    data = [
        (torch.randint(0, vocab, (args.batch, t), device="cuda", generator=gen),
         torch.randint(0, vocab, (args.batch * t,), device="cuda", generator=gen))
        for _ in range(4)
    ]
    mask = torch.full((t, t), -1e9, device="cuda").triu(1)
    for i in range(3):
        step_fn(*data[i % 4], mask)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step_fn(*data[i % 4], mask)
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / args.steps
    return args.batch * t / per_step, per_step, float(loss.detach())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtypes", default="f32", help="comma-separated: f32, bf16, f16")
    parser.add_argument("--modes", default="eager,compile", help="comma-separated: eager, compile")
    parser.add_argument("--size", choices=list(SIZES), default="gpt2")
    parser.add_argument("--attention", default="composed", help="comma-separated: composed, sdpa")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    layers, d, heads, t, mlp, vocab = SIZES[args.size]
    for attention in args.attention.split(","):
        if attention not in ("composed", "sdpa"):
            raise SystemExit(f"unknown attention {attention!r}: expected composed or sdpa")
        for dtype in args.dtypes.split(","):
            for mode in args.modes.split(","):
                run(args, dtype, mode, (layers, d, heads, t, mlp, vocab), attention == "sdpa")


def run(args, dtype, mode, sizes, sdpa):
    """Times one (dtype, mode) pair and prints its line."""
    if dtype not in ("f32", "bf16", "f16") or mode not in ("eager", "compile"):
        raise SystemExit(f"unknown dtype {dtype!r} or mode {mode!r}: expected f32/bf16/f16 and eager/compile")
    layers, d, heads, t, mlp, vocab = sizes
    torch.manual_seed(0)
    model = Gpt(layers, d, heads, t, mlp, vocab, sdpa).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)
    forward = torch.compile(model) if mode == "compile" else model

    # f16 autocast with dynamic loss scaling (GradScaler's defaults), as regflow's
    # Precision::F16: unscale, clip, then a step the scaler may skip.
    half = {"bf16": torch.bfloat16, "f16": torch.float16}.get(dtype)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == "f16")

    def step(ids, targets, mask):
        with torch.autocast("cuda", dtype=half or torch.float32, enabled=half is not None):
            loss = forward(ids, targets, mask)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    tokens, per_step, loss = tokens_per_second(model, step, args, t, vocab)
    print(f"pytorch {mode} {dtype}{' sdpa' if sdpa else ''} on {torch.cuda.get_device_name()}: {per_step * 1e3:.1f} ms/step, "
          f"{tokens:.0f} tokens/s (last loss {loss:.4f})")


if __name__ == "__main__":
    main()
