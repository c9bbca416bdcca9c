#!/usr/bin/env bash
# The committed RULER results (results/ruler/): the five embedded models and the Gated DeltaNet
# constant-gate sweep (lambda 0, 0.5, 1) on RULER's 11 synthetic tasks at 1K and 2K tokens, depths
# 0/50/100 (the target's position where a task has one), SAMPLES samples per cell; then the compact
# copy that is committed. Runs on any device (`--device`, default auto); the committed copy says where
# it ran in each unit's meta.json.
#
#   bash scripts/ruler_results.sh [WORK_FOLDER] [COMMITTED_FOLDER]
set -euo pipefail
work=${1:-results/ruler-work}
committed=${2:-results/ruler}
samples=${SAMPLES:-10}
grid=(-t ruler-synthetic --lengths 1k,2k --depths 0,50,100 --samples-per-cell "$samples" --dtype float32)

ccq-eval run -m tiny-gla -m tiny-gla-ccq -m tiny-gdn -m tiny-gdn-ccq -m tiny-transformer "${grid[@]}" -o "$work"
ccq-eval run -m tiny-gdn --ccq-attach "lambda=0,0.5,1" "${grid[@]}" -o "$work"
ccq-eval archive "$work" "$committed"
ccq-eval compare "$committed" --summary
