#!/usr/bin/env bash
# The GPU measurements behind results/, by named step, on one machine:
#
#   bash scripts/gpu.sh [--dry-run] STEP[:PART,PART...] ...
#   bash scripts/gpu.sh tests attention train-steps        # steps run in the order given
#   bash scripts/gpu.sh attention:leaderboard,n4096 train-steps:large
#
# Steps (and their parts; a step without parts runs them all):
#   tests        the GPU test suite: scripts/gpu_suite.py over tests/attention (fp32, fp16, bf16; fixed tiles,
#                FLASH_ATTN_AUTOTUNE=0) -> tests/gpu-tests.json; parts are other test paths (tests:tests/model)
#   attention    bench_attention.py, bf16, flash against SDPA's FlashAttention-2 and cuDNN kernels and FlexAttention
#                in the same run:
#                  leaderboard  --preset leaderboard --graph-timing         (B1 H16 N16384 D64 causal)
#                  n4096        B1 H16 N4096 D64 causal, --graph-timing
#                  n8192        B2 H16 N8192 D64 and D128, causal and not
#                  n1024        B4 H20 N1024 D64 causal, --graph-timing     (the large model's attention)
#                  variants     --preset variants --graph-timing (GQA, window, documents, softcap, all four;
#                               against flex, sdpa, cuDNN)
#                  training     --preset training --graph-timing --rounds 3 (the shapes models train with, against
#                               cuDNN and FlashAttention-2; medians of 3 rounds taking turns)
#   train-steps  bench_model.py --mode train-step, bf16, compiled, one CUDA graph a step, flash; no clipping, so the
#                optimizer steps during the backward: ours with --optimizer adamw against Hugging Face Llama, then
#                ours with --optimizer adamw-bf16. Parts: small (batch 16, context 1024), large (batch 4, context
#                1024), 2.7B (batch 4, context 512)
#   headline     the README's first command, python train.py --attn flash --dtype bf16 (its defaults: small, batch
#                16, context 1024, 1000 steps of the built-in corpus, compiled, CUDA graph), W&B disabled
#   loop         the training loop's overhead on one GPU: bench_model.py's train-step of small (batch 16, context
#                1024, flash, bf16, compiled, CUDA graph), then train.py --attn flash --dtype bf16 for 300 steps;
#                prints both step times
#   train-variants  train.py, small, bf16, flash, its defaults (compiled, a CUDA graph where the run allows one), 300
#                steps on the built-in corpus as BPE (prepare_data.py): the plain model, the same with
#                --pack-documents, with GQA (4 kv heads), windows of 256 (LLLG) and documents, and with a softcap
#                of 50 too: losses and step times side by side
#   fp8          float8 training against bf16 in the same run (torchao: on a machine without network access, put
#                its wheel in ./.wheels):
#                  steps  bench_model.py train-step, large (b4 T1024) and 2.7B (b4 T512), compiled, CUDA graph,
#                         --optimizer adamw-bf16, --fp8 off,tensorwise,rowwise; large also profiled (kernel
#                         categories of each)
#                  loss   train.py --size large --context-length 1024 --batch-size 4, 1000 steps, bf16 then --fp8
#                         tensorwise (torchao's fastest recipe), with seeds 0 to 3 (FP8_SEEDS): the loss curves
#                         side by side
#   profile      bench_model.py --profile on ours (flash, compiled, CUDA graph; the optimizer steps during the
#                backward on a second stream, so the kernel times of both streams can add up to more than the step),
#                --optimizer adamw then adamw-bf16, then scripts/kernel_categories.py: GPU ms per step by kernel
#                category. Parts: small, large, 2.7B (shapes as in train-steps); by default large and 2.7B
#   quality      time to quality: prepare_data.py python-packages (the installed packages' Python sources, BPE;
#                its token counts in the log), then bench_model.py --mode time-to-quality, small and large, flash,
#                adamw against muon and speedrun (side by side on several GPUs), QUALITY_MINUTES (default 20) of
#                training each, evaluated every 60 s: the time and
#                tokens each takes to reach adamw's final bits per byte, and the curves (curves.png)
#   distributed  torchrun train.py on 2 GPUs (NCCL, NVLink multicast off):
#                  ddp   the large preset, compiled, 100 steps, 8 sequences per GPU, on 1 GPU then 2: the ratio of
#                        their tokens/s, medians of steps 51-100 (measured 1.85x on 2 H200s; goal 1.93x), and
#                        how each rank's GPU time split over steps 12-14 (--profile, before the timed half)
#                  fsdp  the 10B preset (12.7B parameters, more than one GPU holds), context 1024, batch 16,
#                        selective recomputation, bf16 AdamW moments, 40 steps on byte-level text
#
# Each step writes its files under $OUT/<step>/ (results.md/.json/.csv of the benchmarks, a .log per command, a
# directory per train.py run, emptied before the run); `== HH:MM:SS` lines timestamp the steps, and each step's
# summary table prints at the end, after a table of the steps' exit statuses. The exit status is 0 when every
# command succeeded.
#
# Environment:
#   OUT=DIR       where the files go (default ./gpu-out)
#   PYTHON=EXE    the Python that has torch with CUDA (default python3)
#   DEVICE=cpu    distributed only: run its steps with a tiny model over gloo, to check them without GPUs
#   FP8_SEEDS     fp8:loss only: the seeds to train with (default "0 1 2 3")
#   QUALITY_MINUTES  quality only: whole minutes of training, the same for every recipe (default 20)
# A ./.wheels folder, if present, is installed from first (einx and wandb; transformers for train-steps), for
# machines without network access. Triton's cache lives in ./.triton-cache (kept between runs, so autotuning is
# paid once per shape), unless TRITON_CACHE_DIR says otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.triton-cache}"
PY="${PYTHON:-python3}"
OUT="${OUT:-gpu-out}"
DRY_RUN=0
FP8_SEEDS="${FP8_SEEDS:-0 1 2 3}"
QUALITY_MINUTES="${QUALITY_MINUTES:-20}"

STATUS=0          # 1 once any command failed
SUMMARIES=()      # functions that print each step's table at the end
STEP_TABLE=()     # "step  rc  seconds" rows

# run LOG LIMIT_S CMD...: one command, its output to LOG, stopped after LIMIT_S seconds (the benchmarks write what
# they have measured when stopped, and exit 130).
run() {
    local log=$1 limit=$2
    shift 2
    echo "   \$ $*"
    [ "$DRY_RUN" = 1 ] && return 0
    mkdir -p "$(dirname "$log")"
    timeout "$limit" "$@" > "$log" 2>&1
    local rc=$?
    echo "   rc=$rc ($log)"
    [ $rc -ne 0 ] && STATUS=1
    return $rc
}

# fresh DIR: empty DIR before a command writes into it: train.py, bench_model.py and bench_attention.py refuse an
# --out that holds an earlier run.
fresh() {
    [ "$DRY_RUN" = 1 ] || rm -rf "${1:?}"
}

# train_run DIR LIMIT_S ARGS...: train.py into DIR (emptied first), its output to DIR.log.
train_run() {
    local dir=$1 limit=$2
    shift 2
    fresh "$dir"
    run "$dir.log" "$limit" "$PY" train.py "$@" --out "$dir"
}

parts() {  # parts SPEC DEFAULT...: the parts named after "step:", or the defaults
    local spec=$1
    shift
    if [[ $spec == *:* ]]; then tr ',' ' ' <<< "${spec#*:}"; else echo "$@"; fi
}

# --- tests -----------------------------------------------------------------------------------------------------
step_tests() {
    local xdist=()
    # pytest-xdist compiles the many kernel variants in parallel; without it the suite runs in one process.
    "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 14)
    # shellcheck disable=SC2046  # the test paths are meant to split
    run "$OUT/tests/gpu-tests.log" 450 "$PY" scripts/gpu_suite.py --out "$OUT/tests/gpu-tests.json" \
        -- $(parts "$1" tests/attention) "${xdist[@]}" -q -m "slow or not slow"
    SUMMARIES+=(summary_tests)
}
summary_tests() {
    echo "## tests ($OUT/tests/gpu-tests.json)"
    [ -f "$OUT/tests/gpu-tests.log" ] || { echo "(no log)"; return; }
    grep -E "^---- (FAILED|ERROR)" "$OUT/tests/gpu-tests.log" | head -20
    tail -1 "$OUT/tests/gpu-tests.log"
}

# --- attention -------------------------------------------------------------------------------------------------
PEERS=(--backends flash,sdpa-flash,sdpa-cudnn,flex --baseline sdpa-cudnn --no-plots)
step_attention() {
    local part dir
    for part in $(parts "$1" leaderboard n4096 n8192 n1024 variants training); do
        dir="$OUT/attention/$part"
        echo "-- attention $part"
        fresh "$dir"
        case $part in
            leaderboard) run "$dir.log" 180 "$PY" bench_attention.py --preset leaderboard --no-plots --graph-timing \
                             --out "$dir" ;;
            n4096) run "$dir.log" 120 "$PY" bench_attention.py --batch 1 --heads 16 --seq-lens 4096 --d-heads 64 \
                       --causal yes "${PEERS[@]}" --graph-timing --out "$dir" ;;
            n8192) run "$dir.log" 240 "$PY" bench_attention.py --batch 2 --heads 16 --seq-lens 8192 --d-heads 64,128 \
                       --causal both "${PEERS[@]}" --out "$dir" ;;
            n1024) run "$dir.log" 120 "$PY" bench_attention.py --batch 4 --heads 20 --seq-lens 1024 --d-heads 64 \
                       --causal yes "${PEERS[@]}" --graph-timing --out "$dir" ;;
            variants) run "$dir.log" 300 "$PY" bench_attention.py --preset variants --graph-timing --no-plots \
                          --out "$dir" ;;
            training) run "$dir.log" 600 "$PY" bench_attention.py --preset training --graph-timing --no-plots \
                          --backends flash,sdpa-cudnn,sdpa-flash --iters 30 --rounds 3 --out "$dir" ;;
            *) echo "unknown part attention:$part (leaderboard, n4096, n8192, n1024, variants, training)"; STATUS=1 ;;
        esac
    done
    SUMMARIES+=(summary_attention)
}
summary_attention() {
    echo "## attention: ms, bf16 ($OUT/attention/*/results.json)"
    summarize attention "$OUT"/attention/*/results.json
}

# --- train-steps -----------------------------------------------------------------------------------------------
shape() {  # the batch and context of each training-step config
    case $1 in
        small) echo "--batch-size 16 --context-lengths 1024" ;;
        large) echo "--batch-size 4 --context-lengths 1024" ;;
        2.7B) echo "--batch-size 4 --context-lengths 512" ;;
        *) return 1 ;;
    esac
}
# bench_model.py's train step as the steps here run it: compiled, one CUDA graph, flash. bench_model.py never clips,
# so in one process the optimizer steps during the backward.
TRAIN_STEP=(--dtype bf16 --mode train-step --compile on --cuda-graph on --attn flash)
train_step() {  # train_step LOG LIMIT_S SIZE ARGS...: SIZE's step timed
    local log=$1 limit=$2 size=$3
    shift 3
    # shellcheck disable=SC2046  # shape's flags are meant to split
    run "$log" "$limit" "$PY" bench_model.py --sizes "$size" $(shape "$size") "${TRAIN_STEP[@]}" \
        --warmup 4 --steps 10 "$@"
}
step_train_steps() {
    local size
    for size in $(parts "$1" small large 2.7B); do
        echo "-- train-steps $size"
        shape "$size" > /dev/null || { echo "unknown part train-steps:$size (small, large, 2.7B)"; STATUS=1; continue; }
        fresh "$OUT/train-steps/$size"
        train_step "$OUT/train-steps/$size.log" 300 "$size" --impl ours,hf --out "$OUT/train-steps/$size"
        fresh "$OUT/train-steps/$size-adamw-bf16"
        train_step "$OUT/train-steps/$size-adamw-bf16.log" 200 "$size" --impl ours --optimizer adamw-bf16 \
            --out "$OUT/train-steps/$size-adamw-bf16"
    done
    SUMMARIES+=(summary_train_steps)
}
summary_train_steps() {
    echo "## train-steps: bf16, compiled, CUDA graph ($OUT/train-steps/*/results.json)"
    summarize train-steps "$OUT"/train-steps/*/results.json
}

# --- headline --------------------------------------------------------------------------------------------------
step_headline() {
    train_run "$OUT/headline/run" 300 --attn flash --dtype bf16 --wandb disabled
    SUMMARIES+=(summary_headline)
}
summary_headline() {
    echo "## headline: python train.py --attn flash --dtype bf16 ($OUT/headline/run/metrics.jsonl)"
    summarize train-variants "$OUT/headline" run
}

# --- loop ------------------------------------------------------------------------------------------------------
step_loop() {
    local dir="$OUT/loop"
    fresh "$dir/bench"
    run "$dir/bench.log" 240 "$PY" bench_model.py --sizes small --mode train-step --dtype bf16 --compile on \
        --cuda-graph on --attn flash --batch-size 16 --context-lengths 1024 --out "$dir/bench"
    train_run "$dir/train" 300 --attn flash --dtype bf16 --steps 300 --eval-every 0 --wandb disabled \
        --keep-checkpoints 0
    SUMMARIES+=(summary_loop)
}
summary_loop() {
    echo "## loop: small, bf16, flash, compiled, CUDA graph, batch 16 x 1024 ($OUT/loop/bench/results.json," \
         "$OUT/loop/train/metrics.jsonl)"
    summarize loop "$OUT/loop"
}

# --- train-variants --------------------------------------------------------------------------------------------
BPE_DATA=data/stdlib-bpe8192
# train.py's short run on BPE: the small model with its defaults (compiled, a CUDA graph), 300 steps
SMALL_300=(--size small --attn flash --dtype bf16 --data "$BPE_DATA" --steps 300 --warmup-steps 30 --log-every 25
           --eval-every 100 --eval-batches 10 --keep-checkpoints 0 --wandb disabled)
step_train_variants() {
    local dir="$OUT/train-variants" common=("${SMALL_300[@]}")
    run "$dir/prepare_data.log" 180 "$PY" prepare_data.py --out "$BPE_DATA" || return
    train_run "$dir/plain" 240 "${common[@]}"
    train_run "$dir/packed" 240 "${common[@]}" --pack-documents
    train_run "$dir/variants" 240 "${common[@]}" --pack-documents --n-kv-heads 4 --window 256 --window-pattern LLLG
    train_run "$dir/softcap" 240 "${common[@]}" --pack-documents --n-kv-heads 4 --window 256 --window-pattern LLLG \
        --attn-softcap 50
    SUMMARIES+=(summary_train_variants)
}
summary_train_variants() {
    echo "## train-variants: small, bf16, flash ($OUT/train-variants/*/metrics.jsonl)"
    summarize train-variants "$OUT/train-variants" plain packed variants softcap
}

# --- quality ---------------------------------------------------------------------------------------------------
PACKAGES_DATA=data/python-packages-bpe8192
step_quality() {
    local dir="$OUT/quality" gpus devices=() rounds=6  # 2 sizes x 3 recipes
    if [[ ! "$QUALITY_MINUTES" =~ ^[1-9][0-9]*$ ]]; then
        echo "   QUALITY_MINUTES must be a whole number of minutes, got '$QUALITY_MINUTES'"; STATUS=1; return
    fi
    # Several GPUs: the recipes side by side, one per GPU. Each recipe: the budget, plus compilation and evaluations
    # off the clock; the benchmark keeps what it measured when the limit stops it.
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    if (( gpus > 1 )); then
        devices=(--devices "$(seq -s, -f 'cuda:%g' 0 $(( gpus - 1 )))")
        rounds=$(( (6 + gpus - 1) / gpus ))
    fi
    local limit=$(( rounds * (60 * QUALITY_MINUTES + 600) ))
    run "$dir/prepare_data.log" 3600 "$PY" prepare_data.py python-packages --out "$PACKAGES_DATA" || return
    run "$dir/bench.log" "$limit" "$PY" bench_model.py --mode time-to-quality --sizes small,large --attn flash \
        --recipes adamw,muon,speedrun --data "$PACKAGES_DATA" --minutes "$QUALITY_MINUTES" --eval-interval-s 60 \
        "${devices[@]}" --out "$dir/bench"
    SUMMARIES+=(summary_quality)
}
summary_quality() {
    echo "## quality: small and large, flash, adamw against muon and speedrun, $QUALITY_MINUTES min each ($OUT/quality/bench/results.md," \
         "curves.png)"
    grep -E "^preparing|^  (train|val):" "$OUT/quality/prepare_data.log" 2>/dev/null
    grep -E "^- " "$OUT/quality/bench/results.md" 2>/dev/null
}

# --- fp8 -------------------------------------------------------------------------------------------------------
step_fp8() {
    local part size dir="$OUT/fp8"
    for part in $(parts "$1" steps loss); do
        case $part in
            steps)
                for size in large 2.7B; do
                    local profile=()
                    [ "$size" = large ] && profile=(--profile "$dir/prof-$size" --profile-steps 2)
                    fresh "$dir/steps-$size"
                    # shellcheck disable=SC2046
                    run "$dir/steps-$size.log" 300 "$PY" bench_model.py --sizes "$size" $(shape "$size") \
                        "${TRAIN_STEP[@]}" --warmup 3 --steps 8 --optimizer adamw-bf16 --fp8 off,tensorwise,rowwise \
                        "${profile[@]}" --out "$dir/steps-$size"
                done
                if [ "$DRY_RUN" = 1 ]; then
                    echo "   \$ $PY scripts/kernel_categories.py $dir/prof-large/*/trace.json 2 --top 40"
                    continue
                fi
                local trace found=0
                for trace in "$dir"/prof-large/*/trace.json; do
                    [ -f "$trace" ] || continue
                    found=1
                    echo "== $(basename "$(dirname "$trace")")"
                    "$PY" scripts/kernel_categories.py "$trace" 2 --top 40
                done > "$dir/profile-large-kernel-categories.txt"
                [ $found = 1 ] || { echo "   no trace.json under $dir/prof-large"; STATUS=1; } ;;
            loss)
                local common=(--size large --context-length 1024 --batch-size 4 --dtype bf16 --attn flash --steps 1000
                              --log-every 50 --eval-every 500 --keep-checkpoints 0 --wandb disabled)
                local seed name
                for seed in $FP8_SEEDS; do
                    name=$(fp8_loss_name "$seed")
                    train_run "$dir/$name-bf16" 300 "${common[@]}" --seed "$seed"
                    train_run "$dir/$name-tensorwise" 300 "${common[@]}" --seed "$seed" --fp8 tensorwise
                done ;;
            *) echo "unknown part fp8:$part (steps, loss)"; STATUS=1 ;;
        esac
    done
    SUMMARIES+=(summary_fp8)
}
fp8_loss_name() { [ "$1" = 0 ] && echo loss || echo "loss-seed$1"; }  # seed 0's files keep their first name
summary_fp8() {
    echo "## fp8: bf16, compiled, CUDA graph ($OUT/fp8/*/results.json, $OUT/fp8/loss-*/metrics.jsonl)"
    summarize train-steps "$OUT"/fp8/steps-*/results.json
    local seed runs=()
    for seed in $FP8_SEEDS; do runs+=("$(fp8_loss_name "$seed")"-{bf16,tensorwise}); done
    summarize train-variants "$OUT/fp8" "${runs[@]}"
}

# --- profile ---------------------------------------------------------------------------------------------------
step_profile() {
    local size dir optimizer trace
    for size in $(parts "$1" large 2.7B); do
        echo "-- profile $size"
        shape "$size" > /dev/null || { echo "unknown part profile:$size (small, large, 2.7B)"; STATUS=1; continue; }
        for optimizer in adamw adamw-bf16; do
            dir="$OUT/profile/$size-$optimizer"
            fresh "$dir"  # its --profile folder inside too: the trace found below is this run's
            # shellcheck disable=SC2046
            run "$dir.log" 240 "$PY" bench_model.py --sizes "$size" $(shape "$size") "${TRAIN_STEP[@]}" \
                --optimizer "$optimizer" --warmup 3 --steps 2 --profile "$dir/prof" --profile-steps 2 --out "$dir"
            [ "$DRY_RUN" = 1 ] && { echo "   \$ $PY scripts/kernel_categories.py $dir/prof/*/trace.json 2 --top 45"; continue; }
            trace=$(find "$dir/prof" -name trace.json 2>/dev/null | head -1)
            if [ -n "$trace" ]; then
                "$PY" scripts/kernel_categories.py "$trace" 2 --top 45 > "$OUT/profile/$size-$optimizer-kernel-categories.txt"
            else
                echo "   no trace.json under $dir/prof"; STATUS=1
            fi
        done
    done
    SUMMARIES+=(summary_profile)
}
summary_profile() {
    local f
    for f in "$OUT"/profile/*-kernel-categories.txt; do
        [ -f "$f" ] || continue
        echo "## profile: $f"
        head -8 "$f"
    done
}

# --- distributed -----------------------------------------------------------------------------------------------
step_distributed() {
    local dir="$OUT/distributed" part n_gpus
    local ddp_model fsdp_model ddp_steps=100 common=(--wandb disabled --keep-checkpoints 0 --eval-every 0 --eval-batches 1)
    if [ "${DEVICE:-cuda}" = cpu ]; then  # a tiny stand-in that checks the commands themselves
        ddp_model=(--size tiny --n-layers 2 --context-length 64 --dtype fp32 --attn sdpa --device cpu)
        fsdp_model=("${ddp_model[@]}")
        ddp_steps=20
    else
        ddp_model=(--size large --context-length 1024 --dtype bf16 --attn sdpa)
        fsdp_model=(--size 10B --context-length 1024 --dtype bf16 --attn sdpa)
        if [ "$DRY_RUN" = 0 ]; then
            n_gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())") || n_gpus=0
            if [ "$n_gpus" -lt 2 ]; then echo "distributed needs 2 GPUs, found $n_gpus"; STATUS=1; return; fi
        fi
    fi
    # NVLink multicast (NVLS, symmetric-memory multicast) stays off: the machines these runs were measured on
    # do not support it.
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    # The 10B run allocates and frees tens of GiB at start-up (full weights, then shards): avoid fragmentation.
    export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
    for part in $(parts "$1" ddp fsdp); do
        case $part in
            ddp)  # the same 8 sequences per GPU, so 2 GPUs should move twice the tokens per second
                local ddp=("${ddp_model[@]}" --data synthetic --steps "$ddp_steps" --log-every 10 "${common[@]}"
                           --parallel ddp)
                torchrun_train "$dir" ddp-1gpu 1 120 "${ddp[@]}" --batch-size 8 --profile "$dir/ddp-1gpu-profile"
                torchrun_train "$dir" ddp-2gpu 2 120 "${ddp[@]}" --batch-size 16 --profile "$dir/ddp-2gpu-profile" ;;
            fsdp)  # this initialisation spikes the loss in the first steps at every size, in one process too; a
                   # peak LR of 3e-4 after 2 warm-up steps diverged on 2 H200s, 1.5e-4 after 10 falls
                torchrun_train "$dir" fsdp-10B-2gpu 2 240 "${fsdp_model[@]}" --batch-size 16 --steps 40 \
                    --warmup-steps 10 --lr 1.5e-4 --min-lr 1.5e-5 --log-every 2 --activation-checkpointing \
                    --recompute selective --optimizer adamw-bf16 "${common[@]}" --parallel fsdp ;;
            *) echo "unknown part distributed:$part (ddp, fsdp)"; STATUS=1 ;;
        esac
    done
    SUMMARIES+=(summary_distributed)
}
torchrun_train() {  # torchrun_train DIR NAME NPROC LIMIT_S ARGS...: train.py into DIR/NAME, log DIR/NAME.log
    local dir=$1 name=$2 nproc=$3 limit=$4
    shift 4
    echo "-- distributed $name"
    [ "$DRY_RUN" = 1 ] || rm -rf "${dir:?}/$name"
    OMP_NUM_THREADS=4 run "$dir/$name.log" "$limit" "$PY" -m torch.distributed.run --standalone \
        --nproc-per-node "$nproc" train.py --out "$dir/$name" "$@"
}
summary_distributed() {
    echo "## distributed ($OUT/distributed/*/metrics.jsonl)"
    summarize distributed "$OUT/distributed"
}

# --- the summary tables ----------------------------------------------------------------------------------------
summarize() {  # summarize KIND PATH...: the table of one step, from the files its commands wrote
    "$PY" - "$@" <<'PYEOF'
import json, statistics, sys
from pathlib import Path

kind, paths = sys.argv[1], [Path(p) for p in sys.argv[2:]]

def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)

def metrics(path):
    """The rows of a metrics.jsonl; [] when there is none."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

if kind == "attention":
    print(f"{'shape':<26} {'backend':<11} {'fwd':>7} {'TFLOP/s':>7} {'bwd':>7} {'fwd+bwd':>8} {'graphed':>8}  status")
    for path in paths:
        if not path.exists():
            continue
        for r in json.loads(path.read_text())["rows"]:
            shape = " ".join([f"B{r['batch']} H{r['heads']} N{r['seq']} D{r['d_head']}",
                              "causal" if r["causal"] else "no mask", *r.get("point", "").split()[6:]])
            print(f"{shape:<26} {r['backend']:<11} {fmt(r.get('fwd_ms')):>7} {fmt(r.get('fwd_tflops'), '.0f'):>7}"
                  f" {fmt(r.get('bwd_ms')):>7} {fmt(r.get('fwdbwd_ms')):>8} {fmt(r.get('fwdbwd_graph_ms')):>8}"
                  f"  {r['status']}")
elif kind == "train-steps":
    print(f"{'size':<6} {'impl':<5} {'attn':<6} {'optimizer':<28} {'ms':>16} {'tokens/s':>9} {'MFU':>6} {'GiB':>6}"
          "  status")
    for path in paths:
        if not path.exists():
            continue
        for r in json.loads(path.read_text())["rows"]:
            optimizer = (r.get("optimizer") or "adamw") + (" in backward" if r.get("overlap_optimizer") else " after")
            optimizer += f" fp8={r['fp8']}" if r.get("fp8") not in (None, "off") else ""
            ms = f"{fmt(r.get('total_ms_mean'), '.2f')} ± {fmt(r.get('total_ms_std'), '.2f')}"
            mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
            print(f"{r['size']:<6} {r['impl']:<5} {r['attn']:<6} {optimizer:<28} {ms:>16}"
                  f" {fmt(r.get('tokens_per_s'), ',.0f'):>9} {mfu:>6} {fmt(r.get('peak_mem_gib'), '.2f'):>6}"
                  f"  {r['status']}")
elif kind == "train-variants":
    names = [str(p) for p in paths[1:]] or ["plain", "packed", "variants"]
    print(f"{'run':<12} {'step ms':>8} {'tokens/s':>9} {'MFU':>6}  losses at each log step; validation")
    for name in names:
        r = metrics(paths[0] / name / "metrics.jsonl")
        train = [x for x in r if "loss" in x and "step_ms" in x]
        val = [x for x in r if "val_loss" in x]
        if not train:
            continue
        last = train[-1]
        mfu = f"{100 * last['mfu']:.1f}%" if last.get("mfu") is not None else "-"
        print(f"{name:<12} {last['step_ms']:>8.1f} {last['tokens_per_s']:>9,.0f} {mfu:>6}  "
              + " ".join(f"{x['loss']:.2f}" for x in train) + "; " + " ".join(f"{x['val_loss']:.3f}" for x in val))
elif kind == "loop":
    # bench_model.py: the mean of its timed steps. train.py: each metrics row's step_ms is the mean over the steps
    # since the previous row (the warm-up steps excluded); the median over the rows.
    bench = paths[0] / "bench" / "results.json"
    rows = [r for r in json.loads(bench.read_text())["rows"] if r.get("status") == "ok"] if bench.exists() else []
    windows = [x["step_ms"] for x in metrics(paths[0] / "train" / "metrics.jsonl") if "step_ms" in x]
    step = rows[0]["total_ms_mean"] if rows else None
    loop = statistics.median(windows) if windows else None
    steps = rows[0]["steps"] if rows else "-"
    print(f"bench_model.py train-step  {fmt(step, '.2f'):>8} ms  (mean of {steps} timed steps)")
    print(f"train.py                   {fmt(loop, '.2f'):>8} ms  (median step_ms of {len(windows)} logged windows)")
    if step is not None and loop is not None:
        print(f"difference                 {loop - step:>+8.2f} ms  ({100 * (loop / step - 1):+.1f}%)")
    print("(train.py with its defaults also clips, so its optimizer runs after the backward, and reads bytes: "
          "vocabulary 256 against bench_model.py's 10000)")
elif kind == "distributed":
    logs = paths[0]
    print(f"{'run':<15} {'tokens/s':>10} {'step ms':>8} {'MFU':>6} {'peak GiB/rank':>14}  losses")
    for name in ("ddp-1gpu", "ddp-2gpu", "fsdp-10B-2gpu"):
        r = metrics(logs / name / "metrics.jsonl")
        if not r:
            continue
        last = r[-1]  # the last logging window: steady state, warm-up excluded
        mfu = f"{100 * last['mfu']:.1f}%" if last.get("mfu") is not None else "-"
        peak = f"{last['mem_peak_gib']:.1f}" if "mem_peak_gib" in last else "-"
        losses = " ".join(f"{x['loss']:.3f}" for x in r)
        print(f"{name:<15} {last['tokens_per_s']:>10,.0f} {last['step_ms']:>8.0f} {mfu:>6} {peak:>14}  {losses}")
    def steady(name):  # the median tokens/s of the windows in the second half of the run
        rows = [x for x in metrics(logs / name / "metrics.jsonl") if "tokens_per_s" in x]
        return statistics.median(x["tokens_per_s"] for x in rows[len(rows) // 2:]) if rows else None
    for name in ("ddp-1gpu", "ddp-2gpu"):
        log = logs / f"{name}.log"
        profiled = [line for line in log.read_text().splitlines() if "profiled steps" in line] if log.exists() else []
        if profiled:
            print(f"{name}: {profiled[-1].strip()}")
    one, two = steady("ddp-1gpu"), steady("ddp-2gpu")
    if one and two:
        print(f"\nDDP 2 GPUs / 1 GPU tokens/s, medians of the second half: {two / one:.2f}x "
              f"(goal >= 1.93x): {'ok' if two / one >= 1.93 else 'BELOW GOAL'}")
    fsdp = metrics(logs / "fsdp-10B-2gpu" / "metrics.jsonl")
    if fsdp:
        falling = fsdp[-1]["loss"] < fsdp[0]["loss"]
        print(f"FSDP 10B loss {fsdp[0]['loss']:.3f} -> {fsdp[-1]['loss']:.3f}: {'falling' if falling else 'NOT FALLING'}")
PYEOF
}

# --- main ------------------------------------------------------------------------------------------------------
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

STEPS="tests attention train-steps headline loop train-variants quality fp8 profile distributed"
steps=()
for arg in "$@"; do
    case $arg in
        -n|--dry-run) DRY_RUN=1 ;;
        -h|--help) usage; exit 0 ;;
        tests|tests:*|attention|attention:*|train-steps|train-steps:*|headline|loop|train-variants|quality|fp8|\
        fp8:*|profile|profile:*|distributed|distributed:*) steps+=("$arg") ;;
        *) echo "unknown step '$arg'; steps: $STEPS (--help)" >&2
           exit 2 ;;
    esac
done
[ ${#steps[@]} -eq 0 ] && { usage; exit 2; }

mkdir -p "$OUT"
if [ -d .wheels ] && [ "$DRY_RUN" = 0 ]; then  # what the GPU image lacks, without network access
    wheels=(einx wandb)
    [[ " ${steps[*]}" == *" train-steps"* ]] && wheels+=(transformers)
    [[ " ${steps[*]}" == *" train-variants"* || " ${steps[*]}" == *" quality"* ]] && wheels+=(tokenizers)
    [[ " ${steps[*]}" == *" fp8"* ]] && wheels+=(torchao)
    "$PY" -m pip install -q --no-index --find-links .wheels "${wheels[@]}" || echo "warning: installing ${wheels[*]} from .wheels failed"
fi

for spec in "${steps[@]}"; do
    name=${spec%%:*}
    echo "== $(date +%T) $spec"
    start=$SECONDS
    before=$STATUS
    STATUS=0
    "step_${name//-/_}" "$spec"
    STEP_TABLE+=("$(printf '%-40s %-6s %6ss' "$spec" "$([ $STATUS = 0 ] && echo ok || echo FAILED)" $((SECONDS - start)))")
    [ $before = 1 ] && STATUS=1
done
echo "== $(date +%T) done"

[ "$DRY_RUN" = 1 ] && exit 0
echo
printf '%s\n' "${STEP_TABLE[@]}"
for summary in "${SUMMARIES[@]}"; do
    echo
    "$summary"
done
exit $STATUS
