"""PyTorch's kernels for the ops of a GPT-2 124M bf16 step, at that step's shapes (batch 8 x
1024 tokens, d_model 768, 12 heads of 64, MLP 3072, vocabulary padded to 50304), timed on one
GPU, for comparison with the per-op profile of regflow's traced step (`benches/gpu/run.sh`,
`op_profile.py`) in the same call: the memory-bound ops (each line gives the microseconds
per call, CUDA events around 50 calls after 5 warm-up calls, the median of 5 such rounds,
and the bytes the op must move at least, as GB/s) and causal attention through
`F.scaled_dot_product_attention`, forward and backward (its FLOPs, as TFLOP/s).

    python3 benches/peers/ops_torch.py [--smoke]

`--smoke` runs every line on the CPU at small sizes, to check the script where no GPU is
(its figures mean nothing).

It also times one memory question of regflow's own: its arenas are managed memory
(`cuMemAllocManaged`, preferred on the device; `cuda/src/driver/real.rs`), where PyTorch's
are plain device memory (`cudaMalloc`). `copy` and `add` run on both kinds, the managed
buffers made with `cudaMallocManaged`, advised to the device, zeroed by it, and wrapped for
torch through `__cuda_array_interface__`.
"""

import argparse
import ctypes
import statistics
import time

import torch
import torch.nn.functional as F

ROWS, D, MLP, VOCAB, CLASSES, PARAMS, ATTENTION = 8 * 1024, 768, 3072, 50304, 50257, 124_439_808, (8, 12, 1024, 64)


def timed(fn, calls=50, rounds=5):
    if not torch.cuda.is_available():
        # --smoke: the host's clock, a couple of calls.
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        per.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(per)


def report(name, us, moved):
    print(f"torch {name:42s} {us:8.1f} us  {moved / 1e6:8.1f} MB  {moved / us / 1e3:7.0f} GB/s", flush=True)


def report_flops(name, us, flops):
    print(f"torch {name:42s} {us:8.1f} us  {flops / 1e9:8.1f} GFLOP  {flops / us / 1e6:6.0f} TFLOP/s", flush=True)


class MemLocation(ctypes.Structure):
    """`cudaMemLocation`: a kind of location and its id."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Managed:
    """A managed allocation preferred on device 0, seen by torch through the CUDA array
    interface (the way regflow's arenas are allocated)."""

    def __init__(self, shape, dtype):
        cudart = None
        for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
            try:
                cudart = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if cudart is None:
            raise OSError("no libcudart")
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.tensor([], dtype=dtype).element_size()
        ptr = ctypes.c_void_p()
        assert cudart.cudaMallocManaged(ctypes.byref(ptr), ctypes.c_size_t(nbytes), 1) == 0
        # cudaMemAdviseSetPreferredLocation = 3, on device 0: CUDA 13 takes a location
        # {cudaMemLocationTypeDevice = 1, 0}, CUDA 12 the device's ordinal.
        location = MemLocation(1, 0) if torch.version.cuda.startswith("13") else ctypes.c_int(0)
        advised = cudart.cudaMemAdvise(ptr, ctypes.c_size_t(nbytes), 3, location)
        print(f"  managed: {nbytes} bytes at {ptr.value:#x}, cudaMemAdvise -> {advised}", flush=True)
        assert cudart.cudaMemset(ptr, 0, ctypes.c_size_t(nbytes)) == 0
        cudart.cudaDeviceSynchronize()
        typestr = {torch.float32: "<f4", torch.bfloat16: "<V2"}[dtype]
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr.value, False),
                                         "version": 2, "strides": None}
        self.dtype = dtype

    def tensor(self):
        t = torch.as_tensor(self, device="cuda")
        return t.view(self.dtype) if self.dtype == torch.bfloat16 else t


def main():
    global ROWS, D, MLP, VOCAB, CLASSES, PARAMS, ATTENTION
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="small sizes on the CPU: a check of the script")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.smoke:
        ROWS, D, MLP, VOCAB, CLASSES, PARAMS, ATTENTION = 64, 32, 128, 136, 130, 10_000, (1, 2, 64, 16)
        dev = "cpu"
        print("pytorch", torch.__version__, "on the CPU, --smoke sizes (no figures)", flush=True)
    else:
        dev = "cuda"
        print("pytorch", torch.__version__, "on", torch.cuda.get_device_name(), flush=True)
    f32 = lambda *s: torch.randn(*s, device=dev)
    b16 = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)

    # Plain copies and adds: the memory's bandwidth, device memory against managed.
    a, b, out = f32(ROWS, MLP), f32(ROWS, MLP), f32(ROWS, MLP)
    n = a.numel() * 4
    report("copy f32 [8192, 3072], device memory", timed(lambda: out.copy_(a)), 2 * n)
    report("add f32 [8192, 3072], device memory", timed(lambda: torch.add(a, b, out=out)), 3 * n)
    try:
        if dev != "cuda":
            raise RuntimeError("no GPU")
        ma, mb, mo = (Managed((ROWS, MLP), torch.float32) for _ in range(3))
        ta, tb, to = ma.tensor(), mb.tensor(), mo.tensor()
        ta.copy_(a)
        tb.copy_(b)
        report("copy f32 [8192, 3072], managed memory", timed(lambda: to.copy_(ta)), 2 * n)
        report("add f32 [8192, 3072], managed memory", timed(lambda: torch.add(ta, tb, out=to)), 3 * n)
        assert torch.equal(to, a + b)
    except Exception as e:  # noqa: BLE001 - the comparison is optional, the rest is not
        print("managed memory not timed:", e, flush=True)

    # The step's ops at its shapes.
    x = b16(ROWS, MLP)
    bias = b16(MLP)
    report("bias + gelu(tanh) bf16 [8192, 3072]", timed(lambda: F.gelu(x + bias, approximate="tanh")),
           2 * x.numel() * 2 + x.numel() * 2)
    pre = (x + bias)
    report("gelu(tanh) bf16 [8192, 3072]", timed(lambda: F.gelu(pre, approximate="tanh")), 2 * x.numel() * 2)
    dy = b16(ROWS, MLP)
    report("gelu(tanh) backward bf16 [8192, 3072]",
           timed(lambda: torch.ops.aten.gelu_backward(dy, pre, approximate="tanh")), 3 * x.numel() * 2)

    h = f32(ROWS, D)
    w, bb = torch.ones(D, device=dev), torch.zeros(D, device=dev)
    report("layer_norm f32 [8192, 768] -> bf16 out",
           timed(lambda: F.layer_norm(h, (D,), w, bb).to(torch.bfloat16)), h.numel() * (4 + 2))
    hh = h.clone().requires_grad_(True)
    ww = w.clone().requires_grad_(True)
    bb2 = bb.clone().requires_grad_(True)
    y = F.layer_norm(hh, (D,), ww, bb2)
    g = torch.randn_like(y)

    def ln_back():
        torch.autograd.grad(y, (hh, ww, bb2), g, retain_graph=True)

    report("layer_norm backward f32 [8192, 768]", timed(ln_back), h.numel() * 4 * 3)

    logits = b16(ROWS, VOCAB)
    labels = torch.randint(0, CLASSES, (ROWS,), device=dev)
    report("cross_entropy bf16 [8192, 50304] (fwd)",
           timed(lambda: F.cross_entropy(logits, labels)),
           logits.numel() * 2)
    lg = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(lg, labels)

    def ce_back():
        torch.autograd.grad(loss, lg, retain_graph=True)

    report("cross_entropy backward bf16 [8192, 50304]", timed(ce_back), logits.numel() * 2 * 2)

    grads = f32(PARAMS)
    report("sum of squares f32 [124M] (grad norm)", timed(lambda: torch.linalg.vector_norm(grads)), grads.numel() * 4)
    cols = b16(ROWS, 3 * D)
    report("column sum bf16 [8192, 2304] (bias grad)", timed(lambda: cols.sum(0, dtype=torch.float32)),
           cols.numel() * 2)

    # One layer's causal attention (regflow's `attention` and `attention_grad`, 12 of each a
    # step): [B, H, T, D] = [8, 12, 1024, 64]; FLOPs of the causal half (forward: two
    # products; backward: five, as flash attention recomputes the scores).
    b, heads, t, d = ATTENTION
    q, k, v = (torch.randn(b, heads, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    forward = 2 * 2 * b * heads * t * t * d / 2
    report_flops("attention forward bf16 (sdpa, causal)",
                 timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), forward)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dout = torch.randn_like(out)

    def attention_back():
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    report_flops("attention backward bf16 (sdpa, causal)", timed(attention_back), 2.5 * forward)


if __name__ == "__main__":
    main()
