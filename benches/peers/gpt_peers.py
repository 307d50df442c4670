"""One training step (forward, backward, global-norm clipping, AdamW) of the character GPT
of `train_char_gpt` in JAX (jit) and PyTorch (eager): milliseconds per step, for
comparison with `cargo run --release --example bench_gpt`. The same model as
examples/common/gpt.rs: 2 pre-LayerNorm blocks, d_model 64, 4 heads, context 64, batch 16,
vocabulary 65, learned token and position embeddings, separate Q/K/V projections, scaled
scores plus an additive causal mask (0 / -1e9), the tanh-approximated GELU, a final
LayerNorm and logits from the tied token embedding; AdamW(lr 6e-3, betas 0.9/0.999, eps
1e-8, decoupled weight decay 0.01 on every parameter), gradients clipped to norm 1.
Random token batches. Thread counts come from the caller (`gpt.sh` sets them)."""

import sys
import time

import numpy as np

BATCH, T, D, H, LAYERS, VOCAB, MLP = 16, 64, 64, 4, 2, 65, 256
LR, BETAS, EPS, WD, CLIP = 6e-3, (0.9, 0.999), 1e-8, 0.01, 1.0
STEPS, WARMUP = 50, 5


def batches():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, VOCAB, (BATCH, T)), rng.integers(0, VOCAB, BATCH * T)) for _ in range(WARMUP + STEPS)]


def mask():
    return np.where(np.tril(np.ones((T, T), dtype=bool)), 0.0, -1e9).astype(np.float32)


def init_params(rng):
    """GPT-2's initialization, as examples/common/gpt.rs draws it (other random numbers)."""
    normal = lambda shape, std: (rng.standard_normal(shape) * std).astype(np.float32)
    zeros, ones = (lambda n: np.zeros(n, np.float32)), (lambda n: np.ones(n, np.float32))
    residual = 0.02 / np.sqrt(2 * LAYERS)
    params = {"wte": normal((VOCAB, D), 0.02), "wpe": normal((T, D), 0.01), "lnf_g": ones(D), "lnf_b": zeros(D)}
    for l in range(LAYERS):
        for name, (i, o, std) in {
            "q": (D, D, 0.02), "k": (D, D, 0.02), "v": (D, D, 0.02), "o": (D, D, residual),
            "fc": (D, MLP, 0.02), "proj": (MLP, D, residual),
        }.items():
            params[f"{l}.{name}.w"], params[f"{l}.{name}.b"] = normal((i, o), std), zeros(o)
        for ln in ("ln1", "ln2"):
            params[f"{l}.{ln}.g"], params[f"{l}.{ln}.b"] = ones(D), zeros(D)
    return params


def forward(p, ids, targets, causal, ops):
    """The loss, written once over `ops` (jax.numpy or torch functions)."""
    layer_norm = ops.layer_norm

    def heads(x):
        return ops.swap_heads(x.reshape(BATCH, T, H, D // H))

    x = (p["wte"][ids] + p["wpe"]).reshape(BATCH * T, D)
    for l in range(LAYERS):
        lin = lambda x, n: x @ p[f"{l}.{n}.w"] + p[f"{l}.{n}.b"]
        h = layer_norm(x, p[f"{l}.ln1.g"], p[f"{l}.ln1.b"])
        q, k, v = heads(lin(h, "q")), heads(lin(h, "k")), heads(lin(h, "v"))
        scores = q @ ops.swap_last(k) * (1.0 / np.sqrt(D // H)) + causal
        merged = ops.swap_heads(ops.softmax(scores) @ v).reshape(BATCH * T, D)
        x = x + lin(merged, "o")
        x = x + lin(ops.gelu(lin(layer_norm(x, p[f"{l}.ln2.g"], p[f"{l}.ln2.b"]), "fc")), "proj")
    logits = layer_norm(x, p["lnf_g"], p["lnf_b"]) @ p["wte"].T
    return ops.cross_entropy(logits, targets)


def layer_norm(x, g, b):
    """LayerNorm over the last axis, eps 1e-5, biased variance."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / (var + 1e-5) ** 0.5 * g + b


class Ops:
    """The few functions where JAX and PyTorch spell things differently."""

    def __init__(self, **functions):
        self.__dict__.update(functions)


def bench_jax(threads):
    import jax
    import jax.numpy as jnp

    params = {k: jnp.asarray(v) for k, v in init_params(np.random.default_rng(0)).items()}
    causal = jnp.asarray(mask())
    ops = Ops(
        layer_norm=layer_norm, swap_heads=lambda x: jnp.transpose(x, (0, 2, 1, 3)),
        swap_last=lambda x: jnp.swapaxes(x, -1, -2), softmax=lambda s: jax.nn.softmax(s, -1),
        gelu=lambda x: jax.nn.gelu(x, approximate=True),
        cross_entropy=lambda z, y: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z, -1), y[:, None], 1)),
    )
    loss_fn = lambda p, ids, y: forward(p, ids, y, causal, ops)

    @jax.jit
    def step(p, m, v, t, ids, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, ids, y)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        factor = jnp.minimum(1.0, CLIP / (norm + 1e-6))
        grads = jax.tree_util.tree_map(lambda g: g * factor, grads)
        b1, b2 = BETAS
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1**t, 1 - b2**t
        p = jax.tree_util.tree_map(
            lambda p, m, v: p * (1 - LR * WD) - LR * (m / c1) / (jnp.sqrt(v / c2) + EPS), p, m, v)
        return p, m, v, loss

    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    data = [(jnp.asarray(i), jnp.asarray(y)) for i, y in batches()]
    for t, (ids, y) in enumerate(data[:WARMUP], 1):
        params, m, v, loss = step(params, m, v, float(t), ids, y)
    loss.block_until_ready()
    start = time.perf_counter()
    for t, (ids, y) in enumerate(data[WARMUP:], WARMUP + 1):
        params, m, v, loss = step(params, m, v, float(t), ids, y)
    loss.block_until_ready()
    return (time.perf_counter() - start) * 1e3 / STEPS


def bench_torch(threads):
    import torch

    torch.set_num_threads(threads)
    params = {k: torch.tensor(v, requires_grad=True) for k, v in init_params(np.random.default_rng(0)).items()}
    causal = torch.from_numpy(mask())
    ops = Ops(
        layer_norm=lambda x, g, b: torch.nn.functional.layer_norm(x, (D,), g, b, 1e-5),
        swap_heads=lambda x: x.permute(0, 2, 1, 3), swap_last=lambda x: x.transpose(-1, -2),
        softmax=lambda s: torch.softmax(s, -1), gelu=lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        cross_entropy=torch.nn.functional.cross_entropy,
    )
    opt = torch.optim.AdamW(params.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    data = [(torch.from_numpy(i), torch.from_numpy(y)) for i, y in batches()]

    def step(ids, y):
        opt.zero_grad(set_to_none=True)
        loss = forward(params, ids, y, causal, ops)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), CLIP)
        opt.step()
        return loss

    for ids, y in data[:WARMUP]:
        step(ids, y)
    start = time.perf_counter()
    for ids, y in data[WARMUP:]:
        step(ids, y)
    return (time.perf_counter() - start) * 1e3 / STEPS


if __name__ == "__main__":
    framework, threads = sys.argv[1], int(sys.argv[2])
    try:
        ms = {"jax": bench_jax, "torch": bench_torch}[framework](threads)
        print(f"{framework}: {STEPS} steps, {threads} thread(s), {ms:.2f} ms/step")
    except ImportError as e:
        print(f"{framework}: not installed ({e})")
