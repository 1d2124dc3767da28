#!/usr/bin/env bash
# Brings back the run artifacts that left the tip of the tree (benchmarks/logs/ARTIFACTS.md): each from the commit
# ARTIFACTS.tsv names, checked against its sha256. With no PATH, all of them; with PATHs, those.
#   bash benchmarks/logs/restore_artifacts.sh [PATH ...]
# In a clone made with --filter=blob:none, git fetches each blob from the origin as it is restored. The files come
# back untracked and ignored (benchmarks/logs/.gitignore), so that they are not committed again by accident.
set -euo pipefail
cd "$(dirname "$0")/../.."
wanted=" $* "
restored=0
while IFS=$'\t' read -r path bytes sha256 commit status; do
    [ "$status" = removed ] || continue
    [ $# -eq 0 ] || [[ $wanted == *" $path "* ]] || continue
    if [ ! -f "$path" ] || [ "$(sha256sum "$path" | cut -d' ' -f1)" != "$sha256" ]; then
        git restore --source="$commit" --worktree -- "$path"
    fi
    [ "$(sha256sum "$path" | cut -d' ' -f1)" = "$sha256" ] || { echo "sha256 of $path differs" >&2; exit 1; }
    echo "$path ($bytes bytes, from ${commit:0:7})"
    restored=$((restored + 1))
done < <(tail -n +2 benchmarks/logs/ARTIFACTS.tsv)
[ $# -eq 0 ] || [ "$restored" -eq $# ] || { echo "$restored of $# paths are removed artifacts" >&2; exit 1; }
