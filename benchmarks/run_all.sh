#!/usr/bin/env bash
# The living benchmarks that need no GPU, in one command, on smemguard's CPU harness; one results document each
# (benchmarks/harness.py's format) goes to $1 (default: a new directory under /tmp), the tables to stdout. It uses
# README's .venv where there is one, else python3 (or $PYTHON).
#   benchmarks/run_all.sh [OUT]
# The GPU's living set: benchmarks/gpu_session.sh (docs/DEVELOPING.md). vllm_kernel_scan.py runs here too where the
# CUDA vLLM wheel is installed (VLLM_SCAN=1; about 50 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-$(mktemp -d /tmp/smemguard-benchmarks-XXXXXX)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
python="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"  # README's venv
step() { echo; echo "== $1 ($(date +%T))"; }
step "the walk of one incident"
"$python" benchmarks/incident_walk.py --json "$out/incident_walk.json"
step "compiles per incident (CPU harness, sm_90)"
"$python" benchmarks/incident_compiles.py --harness --tree now=. --json "$out/incident_compiles.json"
step "preflight speed: smemguard check --examples for five GPUs, cold"
"$python" benchmarks/preflight_speed.py --json "$out/preflight_speed.json"
step "shared-memory calibration: the example kernels on sm_120"
"$python" benchmarks/smem_sweep.py --vendor nvidia --part examples --arch 120 --out "$out/smem_sweep.csv"
"$python" benchmarks/smem_sweep.py --vendor nvidia --summary --out "$out/smem_sweep.csv"
step "torch.compile matrix: the smoke run of its plumbing (Inductor's C++ kernels, no limit)"
"$python" benchmarks/inductor_matrix.py --device cpu --jobs 2 --out "$out/inductor_matrix" | tail -15
if [ "${VLLM_SCAN:-0}" = 1 ]; then
  step "vLLM's Triton kernels on a T4, an L4 and an RTX 5090"
  "$python" benchmarks/vllm_kernel_scan.py --json "$out/vllm_kernel_scan.json" | tail -80
fi
step "done: results in $out"
