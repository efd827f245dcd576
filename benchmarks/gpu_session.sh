#!/usr/bin/env bash
# One device call: the GPU tests, the healthy-launch overhead, compiles per incident against a
# baseline tree, the vLLM pack's numerics and other people's test suites. Results under $1.
#   benchmarks/gpu_session.sh OUT [BASELINE_TREE] [FIELD_LIMITS] [FIELD_BUDGET_S]
# Needs (carried, never committed): .whl/ (FlagGems, fla-core, Liger-Kernel and their missing
# wheels), .field/ (their tests, vllm/ sources for the numerics; see benchmarks/field_suites.md).
# SUITES (default fla,liger) picks the field suites; lmdeploy's wheels (.field/lmdeploy/whl) are installed into
# its site/ first. COMPILES=0 skips the compiles per incident (no baseline tree carried), NUMERICS=0 the vLLM pack's
# numerics, MODES the field suites' modes (default plain,observe,on). MORE adds the rest of the GPU's living set,
# comma-separated, before the field suites (each a few minutes; mind the device call's limit): recovery
# (recovery_cost.py), speed (recovered_speed.py), core (compile_core.py), crosscheck (preflight_crosscheck.py),
# flaggems (flaggems_sweep.py, needs FlagGems), inductor (inductor_matrix.py --only flex,RTX4090).
set -uo pipefail
cd "$(dirname "$0")/.."
out="$1"; baseline="${2:-.field/smemguard-base}"; limits="${3:-T4}"; budget="${4:-300}"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheels did not install"; exit 2; }
export PYTHONPATH="/tmp/site"
step() { echo "== $1 ($(date +%T))"; }
step "launch overhead first, on a quiet machine"
PYTHONPATH=".:$PYTHONPATH" timeout 150 python3 benchmarks/launch_overhead.py --blocks 40 \
  --json "$out/launch_overhead.json" 2>&1 | tail -13
step "GPU tests"
PYTHONPATH=".:tests:$PYTHONPATH" timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 \
  | tee "$out/gpu_tests.txt" | tail -4
if [ "${COMPILES:-1}" = 1 ]; then
step "compiles per incident"
timeout 240 python3 benchmarks/incident_compiles.py --tree "before=$baseline" --tree after=. \
  --json "$out/incident_compiles.json" 2>&1 | tail -7
fi
if [ -d .field/vllm ] && [ "${NUMERICS:-1}" = 1 ]; then
  step "vLLM pack numerics"
  PYTHONPATH=".:$PYTHONPATH" timeout 180 python3 benchmarks/vllm_pack_numerics.py .field/vllm --limit T4 2>&1 \
    | tee "$out/vllm_pack_numerics.txt" | tail -12
fi
more() { case ",${MORE:-}," in *,$1,*) return 0;; esac; return 1; }
if more recovery; then step "recovery cost"
  timeout 300 python3 benchmarks/recovery_cost.py --json "$out/recovery_cost.json" 2>&1 | tail -5; fi
if more speed; then step "recovered speed"
  timeout 400 python3 benchmarks/recovered_speed.py --json "$out/recovered_speed.json" 2>&1 | tail -45; fi
if more core; then step "the compile-time core"
  timeout 400 python3 benchmarks/compile_core.py --json "$out/compile_core.json" 2>&1 | tail -8; fi
if more crosscheck; then step "preflight against real launches"
  timeout 400 python3 benchmarks/preflight_crosscheck.py --json "$out/preflight_crosscheck.json" 2>&1 | tail -25; fi
if more flaggems; then step "FlagGems' matmul under an emulated L20"
  timeout 500 python3 benchmarks/flaggems_sweep.py --json "$out/flaggems_sweep.json" 2>&1 | tail -9; fi
if more inductor; then step "torch.compile matrix, FlexAttention under an RTX 4090's limit"
  timeout 500 python3 benchmarks/inductor_matrix.py --out "$out/inductor" --only flex,RTX4090 --jobs 12 2>&1 \
    | tail -30; fi
step "field suites"
suites="${SUITES:-fla,liger}"
case ",$suites," in *,lmdeploy,*)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target .field/lmdeploy/site .field/lmdeploy/whl/*.whl || echo "lmdeploy's wheels did not install";;
esac
timeout $((budget + 30)) python3 benchmarks/field_suites.py --smemguard . --suites "$suites" --modes "${MODES:-plain,observe,on}" \
  --limits "$limits" --workers 4 --jobs 4 --budget "$budget" --out "$out" 2>&1 | tail -14
step "done"
