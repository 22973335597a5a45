#!/usr/bin/env bash
# Run the README's Quick start block as a new user would: extracted from README.md (never a copy),
# run verbatim from the repository root by bash, in a shell without any activated venv and with a fresh
# HOME (no ~/.ray, no caches). Then stop the Ray cluster the block started and check the run's
# metrics.jsonl (scripts/check_quickstart.py): rollout_train/kl and max |Δ logprob| exactly 0.0 at
# every step, every step present. Exits non-zero when the block or the check fails. CI runs this.
#
#   scripts/run_quickstart.sh     # the run stays in <printed HOME>/zerokl-runs/
#
# Only the cluster the block started is stopped (its process group): `ray stop` would end every Ray
# process on the machine, e.g. another cluster or a test's ray.init().
set -euo pipefail
cd "$(dirname "$0")/.."

block=$(mktemp)
python3 scripts/check_quickstart.py extract README.md >"$block"
home=$(mktemp -d)
# `ray start` records the cluster here; a later ray.init() without an address would try to join it
address_file="${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray/ray_current_cluster"
address_before=$(cat "$address_file" 2>/dev/null || true)
path=$PATH
if [ -n "${VIRTUAL_ENV:-}" ]; then path=${PATH//"$VIRTUAL_ENV/bin:"/}; fi

pgid=""
group_alive() {  # zombies do not count: a container's init may never reap Ray's daemons
  ps -eo pgid=,stat= | awk -v g="$pgid" '$1 == g && $2 !~ /^Z/ {n++} END {exit !n}'
}
stop_cluster() {
  if [ -n "$pgid" ] && group_alive; then
    kill -TERM -- "-$pgid" 2>/dev/null || true
    for _ in $(seq 20); do group_alive || break; sleep 0.5; done  # then as `ray stop`: SIGKILL what is left
    kill -KILL -- "-$pgid" 2>/dev/null || true
    echo "quick start: stopped the Ray cluster the block started (process group $pgid)"
  fi
  pgid=""
  if [ -f "$address_file" ] && [ "$(cat "$address_file")" != "$address_before" ]; then rm -f "$address_file"; fi
}
trap stop_cluster EXIT
trap 'exit 130' INT TERM

echo "quick start: running the README's block with HOME=$home:"
sed 's/^/    /' "$block"
start=$SECONDS
set -m  # the block becomes a job with a process group of its own, which the daemons of `ray start` keep
env -u VIRTUAL_ENV -u PYTHONHOME HOME="$home" PATH="$path" bash -e "$block" &
pgid=$!
set +m
rc=0
wait "$pgid" || rc=$?
echo "quick start: block exited with $rc after $((SECONDS - start)) s"
stop_cluster
if [ "$rc" -ne 0 ]; then
  echo "quick start FAILED: the README's Quick start block exited with $rc" >&2
  exit "$rc"
fi
.venv/bin/python scripts/check_quickstart.py check "$home/zerokl-runs"
