#!/usr/bin/env bash
# Multi-node launch: start a Ray head, join workers, submit a recipe. Run inside the image
# (docker/Dockerfile.gpu or Dockerfile.cpu) on each node, with host networking.
#
#   docker/launch.sh head   [--port 6379] [--num-cpus N] [--num-gpus G] [ray start args...]
#   docker/launch.sh worker --address HEAD:6379 [--num-cpus N] [--num-gpus G] [ray start args...]
#   docker/launch.sh submit --address HEAD:6379 [--nodes K] -- bash recipes/<recipe>.sh [overrides...]
#   docker/launch.sh stop
#
# `submit` waits until K nodes (default 1) have
# joined, then runs the recipe's driver on this node against the cluster (RAY_ADDRESS): verl's
# ray.init connects instead of starting a local Ray, and tlt-verl drops the recipe's local
# num_cpus / num_gpus sizing, which Ray refuses when connecting. On CPU nodes --num-gpus declares
# logical slots (one per trainer rank), which is what verl's resource pools count.
#
# Ray >= 2.5x starts clusters with token authentication: every node and the driver need the
# head's token (~/.ray/auth_token on the head; elsewhere set RAY_AUTH_TOKEN or copy the file).
# RAY_AUTH_MODE=disabled opts out, on a private network only.
set -euo pipefail
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "launch.sh: $*" >&2; exit 2; }

cmd="${1:-}"; [[ -n "$cmd" ]] || usage; shift
port=6379 address="" num_cpus="" num_gpus="" nodes=1 wait_s="${TLT_LAUNCH_WAIT_S:-300}" extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) port="$2"; shift 2 ;;
    --address) address="$2"; shift 2 ;;
    --num-cpus) num_cpus="$2"; shift 2 ;;
    --num-gpus) num_gpus="$2"; shift 2 ;;
    --nodes) nodes="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) extra+=("$1"); shift ;;
  esac
done
resources=()
[[ -n "$num_cpus" ]] && resources+=(--num-cpus "$num_cpus")
[[ -n "$num_gpus" ]] && resources+=(--num-gpus "$num_gpus")

# The token every node and the driver present: RAY_AUTH_TOKEN, else this file.
token_file="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
have_token() { [[ "$RAY_AUTH_MODE" != token || -n "${RAY_AUTH_TOKEN:-}" || -s "$token_file" ]]; }
need_token() {
  have_token || die "$1: no Ray auth token: copy the head's $token_file here (or set RAY_AUTH_TOKEN)"
}

case "$cmd" in
  head)
    if ! have_token; then
      # ray start refuses to create one itself; the head is where a cluster's token is born.
      mkdir -p "$(dirname "$token_file")"
      (umask 077; python -c 'import secrets; print(secrets.token_hex(32), end="")' > "$token_file")
      echo "launch.sh: head: new cluster token in $token_file; give it to every node and the driver" >&2
    fi
    exec ray start --head --port "$port" --dashboard-host 0.0.0.0 --disable-usage-stats \
      "${resources[@]}" "${extra[@]}" ;;
  worker)
    [[ -n "$address" ]] || die "worker: --address HEAD:PORT is required"
    need_token worker
    exec ray start --address "$address" --disable-usage-stats "${resources[@]}" "${extra[@]}" ;;
  submit)
    [[ -n "$address" ]] || die "submit: --address HEAD:PORT is required"
    [[ $# -gt 0 ]] || die "submit: give the recipe command after --"
    need_token submit
    export RAY_ADDRESS="$address"
    python - "$nodes" "$wait_s" <<'EOF'
import sys, time

import ray

want, wait_s = int(sys.argv[1]), float(sys.argv[2])
ray.init(log_to_driver=False)
deadline = time.time() + wait_s
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want:
        break
    if time.time() > deadline:
        sys.exit(f"launch.sh: submit: {len(alive)} of {want} nodes joined within {wait_s:.0f}s")
    time.sleep(1)
total = ray.cluster_resources()
print(f"launch.sh: {len(alive)} nodes, {total.get('CPU', 0):.0f} CPUs, {total.get('GPU', 0):.0f} GPUs", flush=True)
EOF
    exec "$@" ;;
  stop)
    exec ray stop --force ;;
  *) usage ;;
esac
