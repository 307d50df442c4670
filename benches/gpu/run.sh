#!/usr/bin/env bash
# Runs on a lent GPU machine, from the repository root, after benches/gpu/build.sh filled
# gpu-bin/: every CUDA test binary, then the GPT-2 124M step in regflow and in PyTorch
# (eager and torch.compile) in one run. Finds libnvrtc, libcublas and libnccl in the CUDA
# toolkit or in PyTorch's pip packages.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
libs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
dirs = set()
for base in site.getsitepackages() + ["/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu"]:
    for pattern in ("nvidia/*/lib", "nvidia/cu*/lib", ""):
        for d in glob.glob(os.path.join(base, pattern)):
            if glob.glob(os.path.join(d, "libnvrtc.so*")) + glob.glob(os.path.join(d, "libcublas.so*")) + glob.glob(os.path.join(d, "libnccl.so*")):
                dirs.add(d)
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
status=0
for t in "$here"/test-*; do
  echo "== $(basename "$t")"
  "$t" --test-threads=1 --nocapture 2>&1 | grep -E "test |skipped|panicked|result|running on" || status=1
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
echo "== GPT-2 124M, one GPU"
"$here/bench_gpu_gpt2" --device cuda --size gpt2 --batch "${BATCH:-8}" --steps "${STEPS:-20}" || status=1
python3 "$here/gpt2_torch.py" --batch "${BATCH:-8}" --steps "${STEPS:-20}" --dtype f32 || status=1
exit $status
