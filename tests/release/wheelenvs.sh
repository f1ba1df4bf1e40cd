#!/usr/bin/env bash
# Build capctl's sdist and wheel from a clean copy of the source tree (the files git tracks or would
# track: what a clean clone holds, with this checkout's uncommitted edits) with the standard PEP 517
# build (`python -m build`: sdist, then the wheel from the sdist), and install the wheel into two
# fresh virtual environments:
#   OUT/agent        capctl[agent]        (must hold no cvxpy, scipy, numpy)
#   OUT/coordinator  capctl[coordinator]
# with the exact versions of constraints.txt. `make test` runs the Slurm cluster tests from these
# (tests/slurmcluster/installed.py). Skips everything when the sources did not change since the
# last run (OUT/.sources holds their hash). Usage: tests/release/wheelenvs.sh PYTHON OUT
set -euo pipefail
PYTHON=${1:?usage: wheelenvs.sh PYTHON OUT}
OUT=${2:?usage: wheelenvs.sh PYTHON OUT}
cd "$(dirname "$0")/../.."
REPO=$PWD
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
files() { git -C "$REPO" ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done; }
sum=$(files | xargs -0 sha1sum | sha1sum | cut -d' ' -f1)
if [ -f "$OUT/.sources" ] && [ "$(cat "$OUT/.sources")" = "$sum" ] \
   && [ -x "$OUT/agent/bin/capctl-agent" ] && [ -x "$OUT/coordinator/bin/capctl-coordinator" ]; then
    echo "wheelenvs: up to date ($OUT)"
    exit 0
fi
rm -rf "$OUT/src" "$OUT/dist" "$OUT/agent" "$OUT/coordinator" "$OUT/.sources"
mkdir -p "$OUT/src"
files | tar --null -T - -cf - | tar -xf - -C "$OUT/src"
start=$(date +%s)
"$PYTHON" -m build --outdir "$OUT/dist" "$OUT/src" >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log" >&2; exit 1; }
wheel=$(ls "$OUT"/dist/capctl-*.whl)
echo "wheelenvs: built $(basename "$wheel") and $(basename "$(ls "$OUT"/dist/capctl-*.tar.gz)") in $(( $(date +%s) - start )) s"
for role in agent coordinator; do
    start=$(date +%s)
    "$PYTHON" -m venv "$OUT/$role"
    if ! "$OUT/$role/bin/python" -m pip install -q --disable-pip-version-check -c "$REPO/constraints.txt" \
            "$wheel[$role]" >"$OUT/$role.log" 2>&1; then
        tail -30 "$OUT/$role.log" >&2
        exit 1
    fi
    "$OUT/$role/bin/capctl-$role" --version >/dev/null
    echo "wheelenvs: capctl[$role] in $OUT/$role ($(du -sm "$OUT/$role" | cut -f1) MB) in $(( $(date +%s) - start )) s"
done
echo "$sum" >"$OUT/.sources"
