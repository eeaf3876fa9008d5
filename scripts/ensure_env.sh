#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the CPU stack that installs together.
# Reused as long as requirements/cpu.txt, pyproject.toml and setup.py are unchanged.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TLT_VENV:-$root/.venv}"
stamp="$venv/.tlt-env-stamp"
want="$(cat "$root/requirements/cpu.txt" "$root/pyproject.toml" "$root/setup.py" "$root/scripts/fix_env.py" | sha256sum | cut -c1-16)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
py="${PYTHON:-python3}"
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 11), "tlt-verl pins wheels for Python 3.11"' \
  || { echo "tlt-verl: needs Python 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
echo "tlt-verl: creating the environment in $venv (first run only, about 90 s with uv)..." >&2
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)
# uv downloads and byte-compiles in parallel: 95 s here against 221 s for pip. It does
# not read pip's configuration, so pip's find-links (where machines of this kind keep the CPU
# torch wheel) are passed on; without uv, pip does the same job more slowly.
links=()
for d in ${PIP_FIND_LINKS:-$("$venv/bin/python" -m pip config get global.find-links 2>/dev/null || true)}; do
  links+=(--find-links "$d")
done
if "${pip[@]}" install "uv==0.13.9" 2>/dev/null; then
  install=("$venv/bin/uv" pip install -q --python "$venv/bin/python" "${links[@]}")
  compile=(--compile-bytecode)
else
  install=("${pip[@]}" install)
  compile=()  # pip byte-compiles anyway
fi
# The CPU build of torch first: anything else asking for torch would otherwise pull a
# multi-GB CUDA build.
"${install[@]}" "torch==2.13.0"
# Byte-compiled here, in parallel, rather than by each of the first run's dozen processes on
# import (that made the first start-up 270 s instead of 120 s).
"${install[@]}" "${compile[@]}" "torch==2.13.0" -r "$root/requirements/cpu.txt"
"$venv/bin/python" "$root/scripts/fix_env.py"
"${pip[@]}" install --no-deps --no-build-isolation -e "$root"
"$venv/bin/python" -c 'import torch, vllm, verl, tlt_verl; assert torch.version.cuda is None, "a CUDA torch got installed"'
echo "$want" > "$stamp"
echo "tlt-verl: environment ready" >&2
