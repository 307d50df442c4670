#!/usr/bin/env bash
# Runs on a lent GPU machine, from the repository root, after benches/gpu/build.sh filled
# gpu-bin/. Every step has its own time limit, so one hang cannot eat the lease, and every
# log lands in $OUT (the device tool brings that folder back):
#   1. machine.txt  the GPU, the driver, the libraries found;
#   2. tests.log    every CUDA test binary (op-by-op comparisons, NCCL, training parity,
#                   the slow-kernel invariants), a few at a time, and some under
#                   compute-sanitizer; meanwhile PyTorch's torch.compile fills its cache for
#                   step 3, so compiling stays out of the timed run;
#   3. bench.log    the GPT-2 124M step in regflow (f32, bf16, f16 with loss scaling) and
#                   PyTorch (eager f32, bf16 and f16 with GradScaler, compile bf16), regflow's GEMM against torch.matmul on the same
#                   shapes, and a traced regflow step's per-op profile (trace.json, the
#                   GPU's own times from CUDA events, runtime/src/device/cuda.rs), one
#                   after another on an otherwise idle GPU;
#   4. summary.txt  what passed and failed, and every figure (also printed last).
# libnvrtc, libcublas and libnccl come from the CUDA toolkit or PyTorch's pip packages;
# an unversioned link is made for each, since the pip wheels ship only versioned names
# (libnccl.so.2) that cudarc's loader does not try.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-/tmp/regflow-gpu-out}"
logs=/tmp/regflow-gpu-logs
mkdir -p "$out" "$logs" /tmp/regflow-libs
export PYTHONUNBUFFERED=1
BATCH="${BATCH:-8}" STEPS="${STEPS:-10}"

python3 - >"$logs/libs" <<'PY'
import glob, os, site
names = ("libnvrtc", "libnvrtc-builtins", "libcublas", "libcublasLt", "libnccl")
dirs = set()
for base in site.getsitepackages() + ["/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu"]:
    for pattern in ("nvidia/*/lib", "nvidia/cu*/lib", ""):
        for d in glob.glob(os.path.join(base, pattern)):
            for name in names:
                found = sorted(glob.glob(os.path.join(d, name + ".so*")))
                if found:
                    dirs.add(d)
                    link = os.path.join("/tmp/regflow-libs", name + ".so")
                    if not os.path.exists(link):
                        os.symlink(found[0], link)
print(":".join(["/tmp/regflow-libs"] + sorted(dirs)))
PY
export LD_LIBRARY_PATH="$(cat "$logs/libs")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  ls -l /tmp/regflow-libs
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

# 2. Tests, five jobs at a time, 150 s each at most: every test binary, and the op tests
# with the most indexing again under compute-sanitizer's memcheck (out-of-bounds and
# misaligned accesses that a right-looking value would hide). Meanwhile (unless
# TORCH_COMPILE=0) torch.compile warms its cache, so compiling stays out of the timed run.
if [ "${TORCH_COMPILE:-1}" = 1 ]; then
  timeout 170 python3 "$here/gpt2_torch.py" --batch "$BATCH" --steps 1 --dtypes bf16 --modes compile \
    --attention "${TORCH_ATTENTION:-composed,sdpa}" >"$logs/torch-warm.log" 2>&1 &
fi
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
# TESTS="ops_attention cuda_training" runs only those binaries or modules (and their memcheck).
wanted() { [ -z "${TESTS:-}" ] || [[ " $TESTS " == *" $1 "* ]]; }
{
  for t in "$here"/test-*; do
    b=$(basename "$t")
    if [ "$b" = test-cuda_plans ]; then
      # The root crate's `cuda` plan tests are one binary (tests/cuda_plans.rs): a job per
      # module (its file), so they run side by side as when each file was a binary.
      for module in $("$t" --list --format terse 2>/dev/null | sed -n 's/::.*//p' | sort -u); do
        wanted "$module" && echo "$module $t $module::"
      done
    else
      wanted "${b#test-}" && echo "${b#test-} $t"
    fi
  done
  if [ -n "$sanitizer" ]; then
    for t in ops_rows ops_reduce ops_movement ops_elementwise ops_optim ops_attention; do
      wanted "$t" || continue
      echo "memcheck-$t $sanitizer --tool memcheck --leak-check no --error-exitcode 9 $here/test-$t"
    done
  fi
} >"$logs/jobs"
xargs -P 5 -L 1 bash -c '
  name=$0; start=$(date +%s)
  timeout 150 "$@" --test-threads=1 --nocapture >'"$logs"'/test-$name.log 2>&1; rc=$?
  echo "$name exit $rc after $(( $(date +%s) - start )) s" >>'"$logs"'/test-rc' <"$logs/jobs"
for log in "$logs"/test-*.log; do echo "===== $(basename "$log" .log)"; cat "$log"; done >"$out/tests.log"
wait
[ -f "$logs/torch-warm.log" ] && cp "$logs/torch-warm.log" "$out/torch-warm.log"

# 3. Benchmarks, one at a time, most wanted first (F32=0, FUSED=0, GEMM=0, TORCH=0 (PyTorch eager),
# TORCH_COMPILE=0, PROFILE=0, CALLBACKS=0, STAGING=0, F16=0, NSYS=0, LONE_CASTS=0, PADDED=0, UNFOLDED=0,
# UNFOLDED_TABLE=0, UNFOLDED_NORM=0, ATTENTION_AB=0, APART_QKV=0, KERNELS_AB=0, OPS_TORCH=0 leave parts out;
# TORCH_DTYPES=f32,bf16 picks eager's). Each GPT-2 run says on stderr when each step's loss
# arrived, so a run cut short by its limit still shows its pace.
gpt2() { timeout "$1" "$here/bench_gpu_gpt2" --device cuda --size gpt2 "${@:2}"; }
# The padded bf16 step with fused attention alternated, $1 rounds, with the same step given
# the flag $2 (one fold turned off; $3 says what the plain step has), to compare in one call.
padded_against() {
  for round in $(seq "$1"); do
    for flag in "" "$2"; do
      echo "== GPT-2 124M regflow bf16, fused attention, --pad-vocab 64 ${flag:-($3)} (round $round)"
      gpt2 "${GPT2_LIMIT:-120}" --batch "$BATCH" --warmup "${WARMUP:-3}" --steps "$STEPS" --precision bf16 \
        --attention fused --pad-vocab 64 $flag
      echo "exit $?"
    done
  done
}
# The same padded step alternated, $1 rounds, with the kernels compiled with the macro
# definitions $2 (REGFLOW_CUDA_DEFINES, cuda/src/sources.rs: a kernel variant, no rebuild;
# $3 says what the plain step has).
padded_defined() {
  for round in $(seq "$1"); do
    for defines in "" "$2"; do
      echo "== GPT-2 124M regflow bf16, fused attention, --pad-vocab 64, REGFLOW_CUDA_DEFINES=${defines:-\"\" ($3)} (round $round)"
      REGFLOW_CUDA_DEFINES="$defines" gpt2 "${GPT2_LIMIT:-120}" --batch "$BATCH" --warmup "${WARMUP:-3}" --steps "$STEPS" \
        --precision bf16 --attention fused --pad-vocab 64
      echo "exit $?"
    done
  done
}
# The attention entries as before the thirtieth session: unbounded registers, whole tiles.
old_attention="ATT_OCCUPANCY=0,ATT_PART=64"
# The kernels as before the fortieth session: expf for 16-bit data, the cross-entropy's
# statistics one element at a time, the gradient norm's and the layer-norm gradient's loads
# one round trip at a time, a layer norm's bf16 summand and bias element by element, bf16
# rounded by bit arithmetic, exp2f in the attention entries and their tiles loaded by the
# general loop.
old_kernels="FAST16=0,CE_GROUPS=0,NORM_LOADS_AHEAD=0,LN_PIPELINE=0,LN_SUMMAND_RUNS=0,BF16_CVT=0,ATT_FAST_EXP2=0,ATT_TILE_LOADS=0"
{
  full=0
  if [ "${F32:-1}" = 1 ]; then
    echo "== GPT-2 124M regflow f32"
    gpt2 "${GPT2_LIMIT:-120}" --batch "$BATCH" --warmup "${WARMUP:-3}" --steps "$STEPS"; full=$?
    echo "exit $full"
  fi
  if [ "$full" = 0 ] && [ "${CALLBACKS:-1}" = 1 ]; then
    # The same step with a completion callback after every kernel, as before completions
    # were skipped where nobody off the stream waits: the difference is their cost.
    echo "== GPT-2 124M regflow f32, a callback after every kernel"
    REGFLOW_CUDA_CALLBACK_EVERY_KERNEL=1 gpt2 "${GPT2_LIMIT:-120}" --batch "$BATCH" --warmup "${WARMUP:-3}" --steps "$STEPS"
    echo "exit $?"
  fi
  if [ "$full" = 0 ]; then
    echo "== GPT-2 124M regflow bf16"
    gpt2 "${GPT2_LIMIT:-120}" --batch "$BATCH" --warmup "${WARMUP:-3}" --steps "$STEPS" --precision bf16
    echo "exit $?"
    if [ "${FUSED:-1}" = 1 ]; then
      # Each block's attention as one op (flash attention on tensor cores in bf16 and
      # f16; one thread per query or key in f32).
      for precision in bf16 f16 f32; do
        echo "== GPT-2 124M regflow $precision, fused attention"
        gpt2 "${GPT2_LIMIT:-120}" --batch "$BATCH" --warmup "${WARMUP:-3}" --steps "$STEPS" --precision "$precision" \
          --attention fused
        echo "exit $?"
      done
      if [ "${PADDED:-1}" = 1 ]; then
        # The vocabulary padded to a multiple of 64 (50304 columns, the loss over the real
        # 50257: the same model), so the logits' products need no staging; alternated with
        # the unpadded bf16 step, PADDED_ROUNDS times, to compare within one call.
        for round in $(seq "${PADDED_ROUNDS:-2}"); do
          for pad in 64 1; do
            echo "== GPT-2 124M regflow bf16, fused attention, --pad-vocab $pad (round $round)"
            gpt2 "${GPT2_LIMIT:-120}" --batch "$BATCH" --warmup "${WARMUP:-3}" --steps "$STEPS" --precision bf16 \
              --attention fused --pad-vocab "$pad"
            echo "exit $?"
          done
        done
        echo "== GPT-2 124M regflow f16, fused attention, --pad-vocab 64"
        gpt2 "${GPT2_LIMIT:-120}" --batch "$BATCH" --warmup "${WARMUP:-3}" --steps "$STEPS" --precision f16 \
          --attention fused --pad-vocab 64
        echo "exit $?"
      fi
      if [ "${UNFOLDED:-1}" = 1 ]; then
        # The casts around layer norms and residual adds as lone casts (fold_casts off).
        padded_against "${UNFOLDED_ROUNDS:-2}" --unfolded-casts "casts folded"
      fi
      if [ "${UNFOLDED_TABLE:-1}" = 1 ]; then
        # The tied table's two gradients summed by an add of their own (fold_table_grads off).
        padded_against "${UNFOLDED_TABLE_ROUNDS:-2}" --unfolded-table-grads "table gradients folded"
      fi
      if [ "${UNFOLDED_NORM:-1}" = 1 ]; then
        # The residual adds and the residual gradients' sums each an add of its own
        # (fold_norm_inputs and fold_norm_grads off).
        padded_against "${UNFOLDED_NORM_ROUNDS:-2}" "--unfolded-norm-grads --unfolded-norm-inputs" "norm folds"
      fi
      if [ "${ATTENTION_AB:-1}" = 1 ]; then
        # The tensor-core attention entries without their occupancy caps and with whole
        # tiles (attention.cu: ATT_OCCUPANCY, ATT_PART), compiled from the same binary.
        padded_defined "${ATTENTION_AB_ROUNDS:-2}" "$old_attention" "attention capped, in parts"
      fi
      if [ "${KERNELS_AB:-1}" = 1 ]; then
        # The kernels as before the fortieth session (old_kernels), compiled from the same binary.
        padded_defined "${KERNELS_AB_ROUNDS:-2}" "$old_kernels" "kernels as now"
      fi
      if [ "${APART_QKV:-1}" = 1 ]; then
        # Three Q/K/V projections and the op over them apart, against one packed projection
        # read in place (Tensor::attention_packed).
        padded_against "${APART_QKV_ROUNDS:-2}" --apart-qkv "Q/K/V packed"
      fi
      if [ "${LONE_CASTS:-1}" = 1 ]; then
        # The same bf16 step with each weight and gradient cast its own launch (fuse_casts
        # off): the difference is the fused casts'.
        echo "== GPT-2 124M regflow bf16, fused attention, lone casts"
        gpt2 "${GPT2_LIMIT:-120}" --batch "$BATCH" --warmup "${WARMUP:-3}" --steps "$STEPS" --precision bf16 \
          --attention fused --lone-casts
        echo "exit $?"
      fi
    fi
    if [ "${STAGING:-1}" = 1 ]; then
      # The same step with every 16-bit product run as it is (no aligned staging of the
      # logits' odd leading dimension, cuda/src/ops/matmul.rs): the difference is staging's.
      echo "== GPT-2 124M regflow bf16, without aligned staging"
      REGFLOW_CUDA_STAGING=0 gpt2 "${GPT2_LIMIT:-120}" --batch "$BATCH" --warmup "${WARMUP:-3}" --steps "$STEPS" --precision bf16
      echo "exit $?"
    fi
    if [ "${F16:-1}" = 1 ]; then
      echo "== GPT-2 124M regflow f16, dynamic loss scaling"
      gpt2 "${GPT2_LIMIT:-120}" --batch "$BATCH" --warmup "${WARMUP:-3}" --steps "$STEPS" --precision f16
      echo "exit $?"
    fi
  else
    # Bisect by size: one layer, one sequence, traced.
    echo "== GPT-2 widths, 1 layer, batch 1, regflow f32, traced"
    gpt2 60 --layers 1 --batch 1 --warmup 1 --steps 2 --trace "$out/trace-small.json"
    echo "exit $?"
    python3 "$here/op_profile.py" "$out/trace-small.json" --pieces 1 --top 30
  fi
  if [ -x "$here/bench_gpu_gpt2.old" ]; then
    # The previous build (copied there by hand), timed in the same call: the baseline of a change.
    for precision in f32 bf16; do
      echo "== GPT-2 124M regflow $precision, previous build"
      timeout "${GPT2_LIMIT:-120}" "$here/bench_gpu_gpt2.old" --device cuda --size gpt2 --batch "$BATCH" \
        --warmup "${WARMUP:-3}" --steps "$STEPS" --precision "$precision"
      echo "exit $?"
    done
  fi
  if [ "${TORCH:-1}" = 1 ]; then
    echo "== GPT-2 124M PyTorch"
    timeout 120 python3 "$here/gpt2_torch.py" --batch "$BATCH" --steps "$STEPS" --dtypes "${TORCH_DTYPES:-f32,bf16,f16}" --modes eager \
      --attention "${TORCH_ATTENTION:-composed,sdpa}"
    echo "exit $?"
  fi
  if [ "${OPS_TORCH:-1}" = 1 ]; then
    # PyTorch's kernels for the step's memory-bound ops and its attention at its shapes,
    # and plain device memory against managed memory (regflow's arenas).
    echo "== PyTorch kernels of the step's ops"
    timeout 90 python3 "$here/ops_torch.py"
    echo "exit $?"
  fi
  if [ "${TORCH_COMPILE:-1}" = 1 ]; then
    timeout 150 python3 "$here/gpt2_torch.py" --batch "$BATCH" --steps "$STEPS" --dtypes bf16 --modes compile \
      --attention "${TORCH_ATTENTION:-composed,sdpa}"
    echo "exit $?"
  fi
  if [ "${GEMM:-1}" = 1 ]; then
    echo "== GEMM"
    timeout 90 "$here/bench_cuda_gemm" --repeats 20
    if [ "${STAGING:-1}" = 1 ]; then
      echo "== GEMM without aligned staging"
      REGFLOW_CUDA_STAGING=0 timeout 90 "$here/bench_cuda_gemm" --repeats 20 | grep logits
    fi
    timeout 90 python3 "$here/gemm_torch.py" --repeats 20
  fi
  if [ "${PROFILE:-1}" = 1 ] && [ "$full" = 0 ]; then
    # PROFILE_PRECISIONS="bf16" profiles one precision only (each traced step takes a
    # while); "bf16:fused" profiles the fused-attention step.
    # With ATTENTION_AB, each fused-attention profile is taken again with the attention
    # entries as before (REGFLOW_CUDA_DEFINES="$old_attention"): their kernels' times side by side.
    for entry in ${PROFILE_PRECISIONS:-f32 bf16 bf16:fused}; do
      # "bf16:fused:64" also pads the vocabulary to a multiple of 64.
      precision=${entry%%:*}; rest=${entry#"$precision"}; rest=${rest#:}
      attention=${rest%%:*}; [ -z "$attention" ] && attention=composed
      pad=${rest#"$attention"}; pad=${pad#:}; [ -z "$pad" ] && pad=1
      variants=("")
      [ "${ATTENTION_AB:-1}" = 1 ] && [ "$attention" = fused ] && variants+=("$old_attention")
      [ "${KERNELS_AB:-1}" = 1 ] && variants+=("$old_kernels")
      for defines in "${variants[@]}"; do
        name="$precision-$attention-$pad"
        [ "$defines" = "$old_attention" ] && name="$name-before"
        [ "$defines" = "$old_kernels" ] && name="$name-kernels-before"
        echo "== GPT-2 124M regflow $precision, $attention attention, --pad-vocab $pad, REGFLOW_CUDA_DEFINES=\"$defines\", traced (CUDA events around each kernel): per-op profile of step 1"
        REGFLOW_CUDA_DEFINES="$defines" gpt2 120 --batch "$BATCH" --warmup 1 --steps 1 --precision "$precision" \
          --attention "$attention" --pad-vocab "$pad" --trace "$out/trace-$name.json"
        echo "exit $?"
        python3 "$here/op_profile.py" "$out/trace-$name.json" --pieces 1 --top 30
      done
    done
  fi
  # Nsight Systems, where the machine has it: the untraced step's kernels as the GPU ran
  # them (kernel time per name, and the gaps between them show as the step minus the sum).
  nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  if [ "${NSYS:-1}" = 1 ] && [ -n "$nsys" ] && [ "$full" = 0 ]; then
    for precision in ${NSYS_PRECISIONS:-f32 bf16}; do
      echo "== nsys: GPT-2 124M regflow $precision, 1 warm-up + 2 steps"
      timeout 150 "$nsys" profile -o "$logs/nsys-$precision" --force-overwrite true --trace cuda \
        "$here/bench_gpu_gpt2" --device cuda --size gpt2 --batch "$BATCH" --warmup 1 --steps 2 --precision "$precision" \
        >"$logs/nsys-$precision.log" 2>&1
      echo "exit $?"
      tail -3 "$logs/nsys-$precision.log"
      timeout 60 "$nsys" stats --report cuda_gpu_kern_sum --format csv "$logs/nsys-$precision.nsys-rep" 2>/dev/null \
        | head -45 >"$out/nsys-kern-$precision.csv"
      timeout 60 "$nsys" stats --report cuda_api_sum --format csv "$logs/nsys-$precision.nsys-rep" 2>/dev/null \
        | head -20 >"$out/nsys-api-$precision.csv"
      head -25 "$out/nsys-kern-$precision.csv" | cut -c1-220
      head -12 "$out/nsys-api-$precision.csv" | cut -c1-200
    done
  fi
  nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv
} >"$out/bench.log" 2>&1

# 4. Summary.
{
  echo "== test binaries"; sort "$logs/test-rc"
  echo "== test results"; grep -hE "^=====|^test result|^test .* FAILED|panicked at|skipped|ERROR SUMMARY" "$out/tests.log" | head -80
  echo "== figures"; grep -hE "^(==|regflow|torch|pytorch) |^  |exit [^0]|error|ms " "$out/bench.log"
} >"$out/summary.txt" 2>&1
cat "$out/summary.txt"
