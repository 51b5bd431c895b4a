#!/usr/bin/env bash
# Record fidelity-matrix rows on one GPU: `rackbed real` of each named scenario under scenarios/real/, with the
# board's power sampled beside every run (nvidia-smi power.draw every 100 ms; `power.json`: per run its wall-clock
# window and the samples in it). What each run keeps: real.json, decisions.csv, run.log (as in this folder).
#   bash results/h200/fidelity/record.sh OUTDIR NAME [NAME ...]
# The whole OUTDIR is packed into OUTDIR.tar.gz after every run, so a run cut short keeps what finished.
set -uo pipefail
out=$1; shift
mkdir -p "$out"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=timestamp,power.draw,utilization.gpu,utilization.memory,clocks.sm,clocks.mem \
  --format=csv,noheader,nounits -lms=100 > "$out/power.csv" 2>/dev/null &
smi=$!
echo "name,start_epoch,end_epoch,rc" > "$out/windows.csv"
for n in "$@"; do
  d="$out/$n"; rm -rf "$d"
  t0=$(date +%s.%N)
  $py -m rackbed.engine.cli.main real "scenarios/real/$n.yaml" --out "$d" --force > "$out/$n.log" 2>&1
  rc=$?
  echo "$n,$t0,$(date +%s.%N),$rc" >> "$out/windows.csv"
  mkdir -p "$d"; mv "$out/$n.log" "$d/run.log"
  find "$d" -type f ! -name real.json ! -name decisions.csv ! -name run.log -delete
  tail -3 "$d/run.log"
  tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
done
kill $smi 2>/dev/null
tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
