#!/usr/bin/env bash
# The sentence/document frontier (bench/frontier_sentence.py) in the background: two lanes, one training process
# each (1 torch thread, nice 19), every cell in bench/out/frontier_sentence/<setting>/<cell>/seed<k> (setting: v10k,
# v1k or doc, as the sweep file's name says; cell names repeat across settings). Resume-safe: widedp
# compare reuses a finished cell (same config hash) and resumes a checkpointed one (every 200 steps), so `start`
# after a crash or a reboot continues where the lanes stopped.
#   bash bench/frontier_sentence_lanes.sh start [1|2]   # start the lanes not running (a running one is left alone)
#   bash bench/frontier_sentence_lanes.sh stop [1|2]    # stop the lanes (their pids in bench/out/frontier_sentence/)
#   .venv/bin/python bench/frontier_sentence_status.py   # what finished, what runs, the table
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=bench/out/frontier_sentence
mkdir -p "$OUT"
export NLTK_DATA="${NLTK_DATA:-$(cd .. && pwd)/shared/nltk_data}" HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1
LANE1="configs/frontier_sentence_v10k_eps8.yaml configs/frontier_sentence_v10k_seeds.yaml"
LANE2="configs/frontier_sentence_v1k.yaml configs/frontier_document_v10k.yaml configs/frontier_sentence_v10k.yaml"

setting() { case "$1" in *document*) echo doc ;; *v1k*) echo v1k ;; *) echo v10k ;; esac; }
export -f setting

running() { [[ -f "$OUT/lane$1.pid" ]] && kill -0 "$(cat "$OUT/lane$1.pid")" 2>/dev/null; }

start() {  # start lane $1 over the sweep files $2
  if running "$1"; then echo "lane $1 runs (pid $(cat "$OUT/lane$1.pid"))"; return; fi
  # two passes: the second runs what was added to a file after the lane had passed it (finished cells are reused)
  setsid nohup nice -n 19 bash -c "for f in $2 $2; do .venv/bin/widedp compare \"\$f\" --out $OUT/\$(setting \$f) \
    --keep-going --no-progress || true; done" >> "$OUT/lane$1.log" 2>&1 &
  echo $! > "$OUT/lane$1.pid"  # a session of its own: its pid is the process group that `stop` ends
  echo "lane $1 started (pid $!): $2; log $OUT/lane$1.log"
}

case "${1:-}" in
  start) if [[ "${2:-1}" == 1 ]]; then start 1 "$LANE1"; fi
         if [[ "${2:-2}" == 2 ]]; then start 2 "$LANE2"; fi ;;
  stop) for n in ${2:-1 2}; do if running "$n"; then kill -- "-$(cat "$OUT/lane$n.pid")"
          for _ in $(seq 30); do running "$n" || break; sleep 1; done; echo "lane $n stopped"; fi; done ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
