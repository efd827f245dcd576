#!/usr/bin/env bash
# The GPU benchmarks in one command (about 4 minutes on an H200 with FlagGems); JSON results go to $1 (default: .).
# Separate: the preflight's cross-check against real launches (python benchmarks/preflight_crosscheck.py, GPU)
# and its speed on the CPU (python benchmarks/preflight_speed.py).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 benchmarks/launch_overhead.py --json "$out/launch_overhead.json"
python3 benchmarks/recovery_cost.py --json "$out/recovery_cost.json"
python3 benchmarks/recovered_speed.py --json "$out/recovered_speed.json"
# Loop and config knobs: bitwise the same output after each change? (about a minute)
python3 benchmarks/knob_bitwise.py "$out/knob_bitwise.json"
# FlagGems' Hopper matmul under an emulated L20 (about 2 minutes), where FlagGems is installed
if python3 -c "import flag_gems" 2>/dev/null; then
  python3 benchmarks/flaggems_sweep.py --json "$out/flaggems_sweep.json"
fi
