#!/bin/bash
# The CUDA paths, on a machine with a GPU (CI has none; the test suite hides CUDA and checks the
# CPU paths): the README's default run eager and compiled, torchrun over NCCL (DDP, FSDP2 and
# its resume) at one rank per GPU of the machine, sample.py with the cache (eager, and the
# compiled static step), eval.py and export.py on a CUDA-trained run, the tests that need
# a GPU, and bench/speed/gpu_speed.py's table (config/gpt2_124m.py's tokens/s, MFU and decoding). One line a step (ok, or FAILED with its log); every log under $LOGS. What its steps
# printed on an H200 is in docs/SPEED.md ("On a GPU").
#
#     bash bench/cuda_check.sh                  # minutes on one GPU (not yet timed as one command)
#     LOGS=/tmp/mine bash bench/cuda_check.sh
set -u
cd "$(dirname "$0")/.."
LOGS=${LOGS:-/tmp/cuda_check}
PY=${PY:-python}
RUNS=$LOGS/runs
rm -rf "$RUNS" && mkdir -p "$RUNS"
failed=0

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, its output in $LOGS/NAME.log
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  if timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1; then
    echo "ok      $name ($((SECONDS - t0)) s): $(grep -v '^\s*$' "$LOGS/$name.log" | tail -1)"
  else
    echo "FAILED  $name (exit $?, $((SECONDS - t0)) s): see $LOGS/$name.log"
    failed=1
  fi
}

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', \
torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())" || exit 1
NPROC=$($PY -c "import torch; print(torch.cuda.device_count())")  # torchrun: a rank per GPU
step default 300 $PY train.py config/small.py --out_dir="$RUNS/default"
step compiled 600 $PY train.py config/small.py --out_dir="$RUNS/compiled" --compile=True
TR="torchrun --standalone --nproc_per_node=$NPROC train.py config/small.py \
    --gradient_accumulation_steps=$NPROC"
step ddp 300 $TR --max_iters=40 --out_dir="$RUNS/ddp"
step fsdp 300 $TR --fsdp=True --optimizer=adamw --max_iters=20 --lr_decay_iters=40 \
    --out_dir="$RUNS/fsdp"
step fsdp_resume 300 $TR --fsdp=True --optimizer=adamw --max_iters=40 --lr_decay_iters=40 \
    --out_dir="$RUNS/fsdp" --init_from=resume
step sample 120 $PY sample.py --out_dir="$RUNS/default" --max_new_tokens=200 --compile=False
step sample_compiled 300 $PY sample.py --out_dir="$RUNS/default" --max_new_tokens=200 \
    --compile=True
step sample_fsdp 120 $PY sample.py --out_dir="$RUNS/fsdp" --max_new_tokens=50
step eval 300 $PY eval.py --out_dir="$RUNS/default" --split=val --lengths=128,256,512,1024
step export 300 $PY export.py --out_dir="$RUNS/default" --hf_dir="$RUNS/hf"
step gpu_tests 300 env ROFORMER_TEST_CUDA=1 $PY -m pytest -q -rs tests/test_train.py -k pin
# the speed at the size users train: config/gpt2_124m.py's training and decoding, one table
step gpu_speed 420 $PY bench/speed/gpu_speed.py && cat "$LOGS/gpu_speed.log"
exit $failed
