#!/usr/bin/env bash
# A/B of source files that need no rebuild (Python, or callers of ops the built extension already has): runs
# COMMAND with FILE... as they are at BASE_REV ("## base") and as they are in the tree ("## tree"), alternating
# ROUNDS times (default 2), so that drift of the card's clocks shows as a spread and not as a difference. The
# tree's files are put back at the end, also when COMMAND fails or the run is interrupted.
#   ROUNDS=2 bash benchmarks/ab_files.sh 7fe0825 "python3 benchmarks/profile_block_host.py --rows 0" \
#     sptr/layers/sphereformer.py sptr/ops/windowing.py
set -u -o pipefail
[ $# -ge 3 ] || { echo "usage: $0 BASE_REV COMMAND FILE..." >&2; exit 2; }
base=$1 command=$2
shift 2
saved=$(mktemp -d)
for f in "$@"; do
  git cat-file -e "$base:$f" || { echo "$f is not in $base" >&2; exit 2; }
  mkdir -p "$saved/$(dirname "$f")" && cp "$f" "$saved/$f"
done
restore() { for f in "$@"; do cp "$saved/$f" "$f"; done; }
trap 'restore "$@"; rm -rf "$saved"' EXIT
for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
  for f in "$@"; do git show "$base:$f" > "$f"; done
  echo "## base ($base), round $round"
  bash -c "$command"
  restore "$@"
  echo "## tree, round $round"
  bash -c "$command"
done
