#!/usr/bin/env bash
# Sourced by .ci/test: NVRTC (the CUDA runtime compiler) from PyPI's `nvidia-cuda-nvrtc`, in a
# virtual environment outside the repository, so the CUDA kernel sources are compiled on a
# machine without a GPU or the CUDA toolkit. On success it exports LD_LIBRARY_PATH and
# REGFLOW_REQUIRE_NVRTC=1 (a missing NVRTC then fails the test instead of skipping it).
# Best effort, like Open MPI: without pip or the package index the test skips with a message.

nvrtc_venv="${REGFLOW_NVRTC_VENV:-${TMPDIR:-/tmp}/regflow-nvrtc}"
nvrtc_lib() {
  find "$nvrtc_venv" -name 'libnvrtc.so.1[0-9]*' -path '*nvidia*' 2>/dev/null | head -n 1
}
if [ -z "$(nvrtc_lib)" ]; then
  { python3 -m venv "$nvrtc_venv" && "$nvrtc_venv/bin/pip" install -q 'nvidia-cuda-nvrtc>=13,<14'; } >/dev/null 2>&1 || true
fi
if lib="$(nvrtc_lib)" && [ -n "$lib" ]; then
  export LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export REGFLOW_REQUIRE_NVRTC=1
  echo "NVRTC for the kernel-source check: $lib"
else
  echo "warning: could not install nvidia-cuda-nvrtc; the CUDA kernel-source check will be skipped" >&2
fi

# ptxas, from PyPI's `nvidia-cuda-nvcc` (same major version), into the same environment:
# NVRTC passes inline PTX through unchecked, so the kernel-source check also assembles the
# PTX for real GPUs when REGFLOW_PTXAS names an assembler. Best effort as above.
ptxas_bin() {
  find "$nvrtc_venv" -name ptxas -path '*nvidia*' -type f 2>/dev/null | head -n 1
}
if [ -n "${REGFLOW_REQUIRE_NVRTC:-}" ] && [ -z "$(ptxas_bin)" ]; then
  "$nvrtc_venv/bin/pip" install -q 'nvidia-cuda-nvcc>=13,<14' >/dev/null 2>&1 || true
fi
if ptxas="$(ptxas_bin)" && [ -n "$ptxas" ]; then
  chmod +x "$ptxas" 2>/dev/null || true
  export REGFLOW_PTXAS="$ptxas"
  echo "ptxas for the kernel-source check: $ptxas"
else
  echo "warning: could not install nvidia-cuda-nvcc; the PTX assembly check will be skipped" >&2
fi
