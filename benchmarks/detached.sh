#!/usr/bin/env bash
# Work longer than one 10-minute device call: start it in a process session of its own (the
# device keeps such a process running between calls while the machine stays warm), then
# watch it from calls that follow one another without a pause (the machine is given back 30 s
# after a call).
#   bash benchmarks/detached.sh start DIR CMD...   # CMD's output in DIR/log, DIR/rc when it ends
#   bash benchmarks/detached.sh wait DIR SECONDS   # until DIR/rc exists or SECONDS pass; DIR -> $OUT/res.tgz
set -uo pipefail
what=${1:?start or wait}; dir=${2:?folder}; shift 2
case "$what" in
  start)
    mkdir -p "$dir"
    setsid nohup bash -c '"$@" > "$0/log" 2>&1; echo $? > "$0/rc"' "$dir" "$@" < /dev/null > /dev/null 2>&1 &
    sleep 2; echo "started in $dir: $*" ;;
  wait)
    limit=${1:?seconds}; start=$SECONDS
    while [ ! -e "$dir/rc" ] && [ $((SECONDS - start)) -lt "$limit" ]; do sleep 5; done
    # The folder as one archive (a device call brings back only so many files; plots included), the progress beside it.
    # Files of 16 MiB and more stay behind: a run's checkpoint in the folder (gigabytes of .distcp) made
    # the archive too large to come back and its gzip outlasted the call (2026-12-02's lease).
    if [ -n "${OUT:-}" ]; then
      (cd "$dir" && find . -type f -size -16M ! -name '*.distcp' ! -name '*.pt' ! -name '*.safetensors' -print0 |
        tar czf "$OUT/res.tgz" --null -T - 2>/dev/null)
      cp "$dir/progress" "$dir/log" "$OUT/" 2>/dev/null
    fi
    if [ -e "$dir/rc" ]; then echo "ended: rc $(cat "$dir/rc")"; else echo "still running after ${limit}s"; fi
    tail -c 3000 "$dir/log" ;;
  *) echo "detached.sh: start or wait, not $what" >&2; exit 2 ;;
esac
