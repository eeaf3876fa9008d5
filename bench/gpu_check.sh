#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): at most 8 minutes on one GPU, one JSON out.
#   bash bench/gpu_check.sh [--out bench/results/gpu_check.json] [--only recipe,kernels]
#   bash bench/gpu_check.sh --cpu-dry-run --out /tmp/gpu_check.json    # what a CPU box can check
# Python: $PYTHON, else the active virtual environment (the GPU image's), else the project's .venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [[ -z $py && -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]]; then py="$VIRTUAL_ENV/bin/python"; fi
if [[ -z $py && -x $root/.venv/bin/python ]]; then py="$root/.venv/bin/python"; fi
py="${py:-$(command -v python3 || command -v python)}"
# The recipes call `python`: the same interpreter.
export PATH="$(cd "$(dirname "$py")" && pwd):$PATH"
cd "$root"
exec "$py" -m bench.gpu_check "$@"
