"""One training step (forward, backward, AdamW) of an MLP 784-1024-1024-10, batch 256,
f32, in JAX (jit) and PyTorch (eager): samples per second, for comparison with
`cargo run --release --example bench_mlp`. Thread counts come from the caller
(`run.sh` sets them per framework)."""

import sys
import time

import numpy as np

BATCH, SIZES, STEPS, WARMUP = 256, (784, 1024, 1024, 10), 30, 3


def data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((BATCH, SIZES[0]), dtype=np.float32), rng.integers(0, 10, BATCH)


def bench_jax(threads):
    import jax
    import jax.numpy as jnp

    x, y = map(jnp.asarray, data())
    key = jax.random.PRNGKey(0)
    params = []
    for i in range(3):
        key, sub = jax.random.split(key)
        w = jax.random.normal(sub, (SIZES[i], SIZES[i + 1])) * jnp.sqrt(2.0 / SIZES[i])
        params.append((w, jnp.zeros(SIZES[i + 1])))

    def loss_fn(params, x, y):
        h = x
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            if i < 2:
                h = jax.nn.relu(h)
        logp = jax.nn.log_softmax(h)
        return -jnp.mean(logp[jnp.arange(BATCH), y])

    def adamw(params, grads, m, v, t, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1**t, 1 - b2**t
        params = jax.tree_util.tree_map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), params, m, v)
        return params, m, v

    @jax.jit
    def step(params, m, v, t, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params, m, v = adamw(params, grads, m, v, t)
        return params, m, v, loss

    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    for t in range(1, WARMUP + 1):
        params, m, v, loss = step(params, m, v, float(t), x, y)
    loss.block_until_ready()
    start = time.perf_counter()
    for t in range(WARMUP + 1, WARMUP + STEPS + 1):
        params, m, v, loss = step(params, m, v, float(t), x, y)
    loss.block_until_ready()
    return BATCH * STEPS / (time.perf_counter() - start)


def bench_torch(threads):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    x, y = data()
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(WARMUP):
        step()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    return BATCH * STEPS / (time.perf_counter() - start)


if __name__ == "__main__":
    framework, threads = sys.argv[1], int(sys.argv[2])
    try:
        rate = {"jax": bench_jax, "torch": bench_torch}[framework](threads)
        print(f"{framework}: {rate:.0f} samples/s")
    except ImportError as e:
        print(f"{framework}: not installed ({e})")
