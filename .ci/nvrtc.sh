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
