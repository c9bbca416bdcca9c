#!/usr/bin/env bash
# One GPU lease, planned as a pipeline that runs on its own on the device machine while short `run`
# calls collect what it has made (a lease is 30 minutes of device time, one command at most 10, and
# the machine goes back 30 s after a call ends, so the work must not depend on the gaps between calls).
#
#   bash scripts/gpu_session.sh start            # first call: snapshot the repo, start the pipeline
#   bash scripts/gpu_session.sh wait SECONDS     # later calls: wait (or until done), then collect
#   bash scripts/gpu_session.sh go SECONDS       # every call: start unless this machine has a pipeline,
#                                                # then wait (a machine that went back is started afresh)
#   bash scripts/gpu_session.sh collect          # pack what exists into $OUT
#
# Stages (each bounded by `timeout`; a failed stage is logged and the next one still runs):
#   1. the five embedded checkpoints trained at once, one process each, beside the GPU tests
#      (pytest -m gpu -n 8; STAGES without "tests" skips them);
#   2. the default suite at the larger grid on the freshly trained models (one process per model);
#   3. the issue-6 benchmark sections (model, training at batch 4, harness + ops, S-NIAH, generation).
#   4. (STAGES with "paper") benchmarks/paper_suite.py for PAPER_ARCH (gla) with CCQ PAPER_CCQ (on), after
#      the tests, before the benchmarks; PAPER_TIMEOUT (1500 s).
# Environment knobs: STAGES (comma-separated subset of tests,train,eval,paper,recheck,bench; default
# tests,train,eval,bench; with "recheck" the benchmarks wait for a later call's `recheck`, RECHECK_WAIT s),
# BENCH (subset of firstrun,model,train4,harness,ops,paths,
# sniah,backbones,generation,tune,profile; default all but paths, backbones, tune and profile; PATHS_ARCHS), GPU_TESTS (the pytest arguments of the GPU tests),
# PROFILES (subset of score,forward,train), PROFILE_DOCS, PROFILE_ARCHS, MODEL_MODES, MODEL_LENGTHS, MODEL_REPEATS,
# HARNESS_FLAGS (e.g. --no-cuda-graphs, or --archs gated_deltanet --ccq on), SNIAH_FLAGS, HARNESS_TIMEOUT (480 s),
# SMOKE_TIMEOUT (480 s: the fused-kernel smoke check before the benchmarks),
# SNIAH_TIMEOUT (900 s: four models, stock HFLM included), TESTS_TIMEOUT (1500 s),
# STEPS (training steps), TRAIN_ARGS (more train_tiny.py arguments), TRAIN_FOLLOWUPS (later training
# stages: ';'-separated train_tiny.py arguments, each stage continuing from the last), MODELS, SAMPLES, COMMIT
# (recorded in model cards and bench reports). E.g. `STAGES=tests,bench COMMIT=$(git rev-parse HEAD) ... start`.
set -uo pipefail
WORK=${GPU_SESSION_WORK:-/tmp/gpu}  # overridable for a dry run off the device
VENV=/tmp/ccq-venv  # the checkout's editable install (install_checkout); its python3 comes first on PATH
cmd=${1:-}

# The checkout installed editable, as the README's set-up does, into a venv over the system Python and
# /tmp/site: ccq_eval.tasks and ccq_eval.models are this tree's tasks/ and models/ only through the
# install's mapping, which PYTHONPATH alone does not give. Run from the tree that the stages use.
install_checkout() {
  if [ ! -x "$VENV/bin/python3" ]; then
    python3 -m venv --without-pip --system-site-packages "$VENV"
    # Where python3 is itself a venv's (the device image's /opt/torch/.venv), --system-site-packages
    # reaches only the base interpreter: torch, pytest and pip come in through a .pth file instead.
    python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
      > "$("$VENV/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/parent-site.pth"
  fi
  "$VENV/bin/python3" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
    >> "$WORK/logs/install.log" 2>&1 || stage "editable install of the checkout FAILED (logs/install.log)"
}

collect() {
  [ -n "${OUT:-}" ] || { echo "collect: OUT is not set"; return 1; }
  cd "$WORK" || return 1
  for d in models/*/; do
    [ -d "$d" ] || continue
    name=$(basename "$d")
    tar czf "$OUT/model-$name.tgz" -C models "$name"
  done
  # A model whose chain has not reached its last stage: its latest finished stage (models-stageN/NAME).
  for d in $(ls -d models-stage*/*/ 2>/dev/null | sort -V -r); do
    name=$(basename "$d"); [ -f "$d/model.safetensors" ] || continue
    [ -e "$OUT/model-$name.tgz" ] || tar czf "$OUT/model-$name.tgz" -C "$(dirname "$d")" "$name"
  done
  # Results as `ccq-eval archive` writes them (xz samples, no resume caches): the raw folder is
  # hundreds of MB, over the 16 MiB a returned file may have.
  for r in results/*/; do
    [ -d "$r" ] && (cd "$WORK/repo" && PATH=$VENV/bin:$PATH PYTHONPATH=/tmp/site:$PWD python3 cli.py archive "$WORK/$r" "$WORK/archive/$(basename "$r")" > /dev/null 2>&1)
  done
  # Autotune winners (small JSON) go inside results.tgz: a call returns at most 8 files.
  find /tmp/triton-cache -name '*.autotune.json' 2>/dev/null | tar czf "$WORK/triton-autotune.tgz" -T - 2>/dev/null
  # The paper suite's `ccq-eval run` output (one log per checkpoint) says what a slow or failed unit did.
  tar czf "$OUT/results.tgz" --exclude='*.safetensors' logs archive bench paper/report paper/work/runs/*.log recheck/*.log \
    triton-autotune.tgz status pipeline.log 2>/dev/null
  ls -la "$OUT"
  tail -n 5 logs/*.log 2>/dev/null | tail -n 60
  [ -f paper/report/paper_suite.md ] && head -n 40 paper/report/paper_suite.md
  cat status
}

stage() { echo "$(date +%T) $*" | tee -a "$WORK/status"; }
MODELS=${MODELS:-tiny-gla tiny-gla-ccq tiny-gdn tiny-gdn-ccq tiny-transformer}

# Stage 2, the GPU grid on the freshly trained checkpoints (run from the current directory's tree).
evaluate() {
  stage "2: evaluation (freshly trained checkpoints where stage 1 made them)"
  for m in $MODELS; do
    [ -f "$WORK/models/$m/model.safetensors" ] && rm -rf "models/$m" && cp -r "$WORK/models/$m" "models/$m"
  done
  python3 scripts/train_tiny.py --register-only --models "$(echo $MODELS | tr ' ' ,)" --out models > /dev/null
  run=(python3 cli.py run --device cuda --no-report --quiet --keep-going -o "$WORK/results/gpu-grid")
  local pids=() m p dtype
  for m in $MODELS; do
    # float32, except DeltaNet, whose chunk_delta_rule refuses it on CUDA (families.CUDA_HALF_ONLY_LAYERS)
    dtype=float32; [ "$m" = tiny-deltanet ] && dtype=bfloat16
    ( timeout "${EVAL_TIMEOUT:-420}" "${run[@]}" --dtype "$dtype" -m "$m" -t s-niah --lengths 1k,2k,4k,8k --depths 0,25,50,75,100 \
        --samples-per-cell "${SAMPLES:-10}" ;\
      timeout 150 "${run[@]}" --dtype "$dtype" -m "$m" -t ppl --lengths 1k,2k,4k,8k,16k,20k \
    ) > "$WORK/logs/eval-$m.log" 2>&1 & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || stage "an evaluation process failed (rc $?)"; done
  stage "2: evaluation done"
}
listed() { [[ ",$2," == *",$1,"* ]]; }  # whether $1 is an item of the comma-separated list $2

pipeline() {
  cd "$WORK/repo" || exit 1
  export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    CCQ_EVAL_GIT_COMMIT=${COMMIT:-unknown}
  mkdir -p "$WORK/logs" "$WORK/models" "$WORK/results" "$WORK/bench"
  stage "install wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    > "$WORK/logs/install.log" 2>&1 || stage "install FAILED"
  install_checkout
  touch "$WORK/installed"  # the `recheck` call waits for this
  export PATH=$VENV/bin:$PATH
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$WORK/logs/gpu.log" 2>&1
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    >> "$WORK/logs/gpu.log" 2>&1
  mkdir -p /tmp/triton-cache && cp -rn "$WORK/autotune-seed/." /tmp/triton-cache/ 2>/dev/null

  want() { listed "$1" "${STAGES:-tests,train,eval,bench}"; }
  pids=(); tests_pid=
  if want train || want tests; then
  stage "1: training (${STEPS:-default} steps) + GPU tests"
  train=(python3 scripts/train_tiny.py --device cuda --data-workers 2 --no-register --code-commit "${COMMIT:-unknown}")
  # Stage 1, then the later stages of TRAIN_FOLLOWUPS (';'-separated train_tiny.py arguments), each
  # continuing from the one before (--init-from). Every model runs its own chain, so a slow family does not
  # hold the others back; stage N writes models-stageN/, the last stage models/.
  IFS=';' read -ra followups <<< "${TRAIN_FOLLOWUPS:-}"
  if want train; then
    for m in $MODELS; do
      (
        n_stages=$((1 + ${#followups[@]})); out() { [ "$1" -eq "$n_stages" ] && echo "$WORK/models" || echo "$WORK/models-stage$1"; }
        # A stage-1 checkpoint carried in the checkout's .stage1/ (copied by `start`) is continued, not retrained.
        if [ -f "$(out 1)/$m/model.safetensors" ]; then stage "1: $m stage 1 carried in"; else
        timeout "${TRAIN_TIMEOUT:-1500}" "${train[@]}" ${STEPS:+--steps "$STEPS"} ${TRAIN_ARGS:-} --models "$m" \
          --out "$(out 1)" > "$WORK/logs/train-$m.log" 2>&1 || { stage "training $m stage 1 failed (rc $?)"; exit 1; }
        fi
        n=1
        for extra in "${followups[@]}"; do
          n=$((n + 1)); stage "1: $m training stage $n"
          timeout "${TRAIN_TIMEOUT:-1500}" "${train[@]}" $extra --init-from "$(out $((n - 1)))" --models "$m" \
            --out "$(out $n)" > "$WORK/logs/train-$m-stage$n.log" 2>&1 || { stage "training $m stage $n failed (rc $?)"; exit 1; }
        done
        stage "1: $m trained"
      ) &
      pids+=($!)
    done
  fi
  if want tests; then
  # The README's GPU command, with 8 workers instead of its 12: the training processes share the CPU
  # (its gpu_long test, which tunes every candidate of fla's kernels in fresh processes and takes longest,
  # is collected first: tests/conftest.py).
  timeout "${TESTS_TIMEOUT:-1500}" python3 -m pytest -m gpu -n 8 -v -rfE --durations=15 -p no:cacheprovider \
    ${GPU_TESTS:-tests} > "$WORK/logs/gpu-tests.log" 2>&1 &
  tests_pid=$!
  # The benchmarks time the GPU alone: with no training beside them, let the tests finish first.
  want train || { wait "$tests_pid"; stage "GPU tests finished (rc $?)"; tests_pid=; }
  fi
  for p in "${pids[@]}"; do wait "$p"; done
  stage "1: training done"
  fi

  want eval && evaluate

  # The paper's suite at 1.3B for one model (benchmarks/README.md); its report is rewritten every 15 s,
  # so a collect while it runs returns the tasks finished so far.
  if want paper; then
    stage "paper suite (${PAPER_ARCH:-gla}, CCQ ${PAPER_CCQ:-on})"
    [ -n "$tests_pid" ] && { wait "$tests_pid"; stage "GPU tests finished (rc $?)"; tests_pid=; }
    timeout -s INT -k 30 "${PAPER_TIMEOUT:-1500}" python3 benchmarks/paper_suite.py --arch "${PAPER_ARCH:-gla}" \
      --ccq "${PAPER_CCQ:-on}" --work "$WORK/paper/work" --out "$WORK/paper/report" \
      --run-arg=--depths=0,25,50,75,100 --run-arg=--samples-per-cell=10 > "$WORK/logs/paper-suite.log" 2>&1 \
      || stage "paper suite rc $?"
  fi

  [ -n "$tests_pid" ] && { wait "$tests_pid"; stage "GPU tests finished (rc $?)"; }

  # The committed grid's re-check (the `recheck` command, whose call brings the checkpoints) runs
  # beside the GPU tests; the benchmarks wait for it, so that they time the GPU alone.
  if want recheck; then
    for _ in $(seq "${RECHECK_WAIT:-900}"); do [ -f "$WORK/recheck.done" ] && break; sleep 1; done
    stage "grid re-check: $(tail -n 2 "$WORK/logs/recheck.log" 2>/dev/null | tr '\n' ' ')"
  fi

  if want bench; then
  stage "3: benchmarks"
  # The benchmarks use the fused kernels (the default) when the smoke check (fused vs fp64 on this
  # GPU) passes, and otherwise measure the unfused and torch paths. On a fresh machine it compiles every
  # fused kernel (Gated DeltaNet's d_k = 256 backward last), which once took over 240 s.
  # SMOKE_TIMEOUT=0 skips it (benchmarks of fla's own families, which run no CCQ kernel).
  smoke_rc=0
  [ "${SMOKE_TIMEOUT:-480}" -gt 0 ] && { timeout "${SMOKE_TIMEOUT:-480}" python3 scripts/fused_smoke.py \
    > "$WORK/logs/fused-smoke.log" 2>&1; smoke_rc=$?; }
  if [ "$smoke_rc" -ne 0 ]; then
    export CCQ_EVAL_CCQ_KERNEL=unfused CCQ_EVAL_TOKEN_LOGPROB=torch
    reason="FAILED the smoke check"; [ "$smoke_rc" -eq 124 ] && reason="did not finish the smoke check in ${SMOKE_TIMEOUT:-480} s"
    stage "fused kernels $reason (rc $smoke_rc): benchmarks use the unfused and torch paths"
  fi
  bench=(python3 benchmarks/bench.py --out "$WORK/bench")
  group() { listed "$1" "${BENCH:-firstrun,model,train4,harness,ops,sniah,generation}"; }
  # Whether a prompt's last position agrees between a whole forward, prefill + one-token steps (eager and
  # graphed) and a float32 copy of the weights, per family (benchmarks/decode_paths.py; stdout).
  group paths && for arch in ${PATHS_ARCHS:-delta_net}; do  # minutes each on a fresh machine (autotuning)
    timeout 240 python3 benchmarks/decode_paths.py --arch "$arch" --length 8192 >> "$WORK/logs/decode-paths.log" 2>&1 \
      || stage "decode paths $arch rc $?"; done
  # A user's first run (its own empty triton cache, ccq-eval's defaults): S-NIAH-1 at 8K, 10 samples.
  group firstrun && { timeout 900 python3 benchmarks/first_run.py --out "$WORK/bench/first-run" \
    > "$WORK/logs/bench-first-run.log" 2>&1 || stage "first run rc $?"; rm -rf "$WORK/bench/first-run/checkpoint" "$WORK/bench/first-run/triton-cache"; }
  group model && { timeout 360 "${bench[@]}" --sections model --archs gla,gated_deltanet --lengths "${MODEL_LENGTHS:-4096,20480}" \
    --modes "${MODEL_MODES:-forward,forward_graphed,train}" --repeats "${MODEL_REPEATS:-5}" --name model > "$WORK/logs/bench-model.log" 2>&1 || stage "bench model rc $?"; }
  # bench.py's defaults: the four models, 32 documents of 20K tokens per timed call, one slice each.
  group harness && { timeout "${HARNESS_TIMEOUT:-480}" "${bench[@]}" --sections harness ${HARNESS_FLAGS:-} \
    --name harness > "$WORK/logs/bench-harness.log" 2>&1 || stage "bench harness rc $?"; }
  # Training at a realistic batch (16K tokens per step), where the GPU, not the host, is the limit.
  group train4 && { timeout 180 "${bench[@]}" --sections model --modes train --archs gla,gated_deltanet --lengths 4096 \
    --batch 4 --repeats 3 --name model-train-batch4 > "$WORK/logs/bench-train-batch.log" 2>&1 || stage "bench train batch rc $?"; }
  group ops && { timeout 100 "${bench[@]}" --sections ops --name ops > "$WORK/logs/bench-ops.log" 2>&1 || stage "bench ops rc $?"; }
  # S-NIAH through the adapter (its defaults: graphs, batched; and batch 1) vs stock HFLM.
  group sniah && { timeout "${SNIAH_TIMEOUT:-900}" "${bench[@]}" --sections sniah --name sniah ${SNIAH_FLAGS:-} \
    > "$WORK/logs/bench-sniah.log" 2>&1 || stage "bench sniah rc $?"; }
  # The cost CCQ adds per backbone (issue 55): forward at 8K, CCQ attached vs fla's model, beside GLA / GDN.
  group backbones && { timeout "${BACKBONES_TIMEOUT:-540}" "${bench[@]}" --sections model --modes forward --lengths 8192 \
    --archs gla,gated_deltanet,delta_net,kda,retnet,mamba2,precond_gated_deltanet --name backbones \
    > "$WORK/logs/bench-backbones.log" 2>&1 || stage "bench backbones rc $?"; }
  group generation && { timeout 300 "${bench[@]}" --sections generation --archs gla --gen-repeats 2 \
    --adapter-chunk-sizes 32768 --name generation > "$WORK/logs/bench-generation.log" 2>&1 || stage "bench generation rc $?"; }
  # The fused CCQ forward's read configs, segment lengths and key normalisation side by side (stdout).
  group tune && { timeout 300 python3 benchmarks/tune_ccq.py --shapes gdn,gla > "$WORK/logs/tune-ccq.log" 2>&1 \
    || stage "tune rc $?"; }
  # Where the time goes (stdout tables only): the harness steps at 20K, and the forward at 20K.
  profile() { listed "$1" "${PROFILES:-score,forward,train}"; }
  group profile && {
    profile score && { timeout 240 python3 benchmarks/profile_forward.py --arch gla --T 20480 --mode score \
      --docs "${PROFILE_DOCS:-8}" --rows 20 > "$WORK/logs/profile-score.log" 2>&1 || stage "profile score rc $?"; }
    for arch in ${PROFILE_ARCHS:-gla gated_deltanet}; do
      profile forward && { timeout 120 python3 benchmarks/profile_forward.py --arch $arch --T 20480 --rows 20 \
        > "$WORK/logs/profile-forward-$arch.log" 2>&1 || stage "profile forward $arch rc $?"; }
      profile train && { timeout 120 python3 benchmarks/profile_forward.py --arch $arch --T 4096 --mode train --rows 20 \
        > "$WORK/logs/profile-train-$arch.log" 2>&1 || stage "profile train $arch rc $?"; }
    done
  }
  fi
  stage "PIPELINE FINISHED"
}

case "$cmd" in
  go)  # the same command for every call of a lease, with the same environment
    if [ ! -f "$WORK/status" ]; then
      echo "no pipeline on this machine: starting one"
      bash "$0" start || exit $?
    fi
    exec bash "$0" wait "${2:-500}" ;;
  start)
    if [ -f "$WORK/status" ]; then echo "already started:"; cat "$WORK/status"; exit 0; fi
    mkdir -p "$WORK"
    rm -rf "$WORK/repo"; mkdir -p "$WORK/repo"; cp -r . "$WORK/repo/"   # immune to later re-syncs
    # Autotune winners of earlier leases (same image, same cap): only the winning config compiles.
    mkdir -p "$WORK/autotune-seed"
    for f in ccq_eval/model/kernels/tuned/*.tgz; do [ -f "$f" ] && tar xzf "$f" -C "$WORK/autotune-seed" --strip-components=2; done
    [ -d .stage1 ] && mkdir -p "$WORK/models-stage1" && cp -r .stage1/. "$WORK/models-stage1/"
    : > "$WORK/status"
    setsid nohup bash "$WORK/repo/scripts/gpu_session.sh" pipeline > "$WORK/pipeline.log" 2>&1 < /dev/null &
    sleep 5; cat "$WORK/status" ;;
  pipeline) pipeline ;;
  wait)
    # A fresh machine (the one that ran `start` went back after 30 s idle) has no pipeline to wait for:
    # say so at once rather than spend the call's device time waiting on nothing.
    if [ ! -f "$WORK/status" ]; then
      echo "no pipeline on this machine (a fresh one: the machine that ran 'start' went back); run 'start' again"
      exit 3
    fi
    deadline=$((SECONDS + ${2:-500}))
    while [ $SECONDS -lt $deadline ] && ! grep -q 'PIPELINE FINISHED' "$WORK/status" 2>/dev/null; do sleep 10; done
    collect ;;
  collect) collect ;;
  recheck)  # a later call whose tree holds the RECHECK_MODELS checkpoints (STAGES with "recheck"):
    # results/gpu-grid's units of those models rerun from their recorded commands and compared sample
    # for sample (scripts/recheck_grid.py), in the pipeline's tree, in the background
    cd "$WORK/repo" || exit 1
    for _ in $(seq 300); do [ -f "$WORK/installed" ] && break; sleep 1; done  # the pipeline's install
    models=${RECHECK_MODELS:-tiny-gla tiny-gla-ccq tiny-gdn tiny-gdn-ccq}
    for m in $models; do cp -r "$OLDPWD/models/$m" models/ || exit 1; done
    export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
      HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PATH=$VENV/bin:$PATH
    mkdir -p "$WORK/recheck" "$WORK/logs"
    setsid nohup bash -c "timeout ${RECHECK_TIMEOUT:-900} python3 scripts/recheck_grid.py results/gpu-grid \
      --out $WORK/recheck/gpu-grid --models $(echo $models | tr ' ' ,) ${RECHECK_TASKS:+--tasks $RECHECK_TASKS}; echo \"rc \$?\"; touch $WORK/recheck.done" \
      > "$WORK/logs/recheck.log" 2>&1 < /dev/null &
    stage "grid re-check started ($models)" ;;
  eval)  # after `wait` saw training finish: the grid from this call's (newer) tree, then collect
    export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
      HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    mkdir -p "$WORK/logs"; install_checkout; export PATH=$VENV/bin:$PATH
    evaluate; collect ;;
  *) echo "usage: $0 start|wait SECONDS|go SECONDS|eval|recheck|collect"; exit 2 ;;
esac
