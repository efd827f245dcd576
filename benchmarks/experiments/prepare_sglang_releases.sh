#!/usr/bin/env bash
# Builds .field/sglang-0.5.5 and .field/sglang-0.5.23 for benchmarks/experiments/sglang_extend_speed.py from SGLang's PyPI
# wheels: of each release, only the files that importing its extend attention reads (its version, its kernel
# modules and the packages above them, as `sglang_extend_speed.py --files` lists them), nothing of its serving
# stack and no dependency: the GPU machine has torch and Triton, and the script answers the device predicates
# SGLang's utils would. `.field/` is ignored by git; the GPU call carries it (`carry: [".field"]`).
#   benchmarks/experiments/prepare_sglang_releases.sh            (PYTHON=... for another interpreter than .venv's)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for release in 0.5.5 0.5.23; do
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$scratch/$release" "sglang==$release"
  "$PYTHON" -m zipfile -e "$scratch/$release"/sglang-"$release"-*.whl "$scratch/$release/unpacked"
  target=.field/sglang-$release
  rm -rf "$target"
  "$PYTHON" benchmarks/experiments/sglang_extend_speed.py --files "$scratch/$release/unpacked" > "$scratch/$release/files"
  "$PYTHON" - "$scratch/$release/unpacked" "$target" "$scratch/$release/files" <<'COPY'
import shutil, sys
from pathlib import Path
source, target, listed = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]).read_text().split()
for relative in listed:
    (target / relative).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source / relative, target / relative)
print(f"{target}: {len(listed)} files, {sum((target / r).stat().st_size for r in listed) // 1024} kB")
COPY
done
