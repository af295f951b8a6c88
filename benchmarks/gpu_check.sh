#!/usr/bin/env bash
# The project's GPU checks in one command, for a GPU machine whose image has torch but not this project's pins:
# transformers 5.23, datasets, evaluate and their missing needs travel as wheels in .whl/ (`pip download` them
# beside the checkout), installed to /tmp/site. Results go to $OUT (default ./gpu_out):
#   1. gpu_check.py's checks at base dims, every model: SDPA/flex vs eager, cached vs uncached decoding, bf16 autocast
#      loss/gradients against fp32 and a short bf16 fit, bf16-weight decoding;
#   2. the README's main job through `accelerate launch --mixed_precision bf16` (the baseline's small preset on the
#      bundled Multi30k, 1,000 steps), its log and results.json;
#   3. gpu_check.py's speed section: training and decoding tok/s, SDPA against flex_attention, every model.
# Each stage has its own time limit, so one that hangs leaves the others their time.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, datasets, evaluate, accelerate, pyarrow; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__, \
'pyarrow', pyarrow.__version__, torch.cuda.get_device_name())"
timeout "${CHECK_S:-170}" python3 benchmarks/gpu_check.py --size base \
    --sections agreement bf16_training bf16_decoding --output "$OUT/gpu_check_base.json" 2>&1 | grep -v Warning
echo "checks rc=${PIPESTATUS[0]}"
timeout "${TRAIN_S:-150}" accelerate launch --num_processes 1 --mixed_precision bf16 training/train.py \
    --max_steps 1000 --eval_steps 500 --save_steps 500 --output_dir /tmp/gpu_run >"$OUT/train_bf16.log" 2>&1
echo "train rc=$?"
tail -n 25 "$OUT/train_bf16.log"
cp /tmp/gpu_run/results.json "$OUT/train_bf16_results.json"
timeout "${SPEED_S:-230}" python3 benchmarks/gpu_check.py --size base --sections speed --reps 3 \
    --models baseline mute hysan mgsa tied mimo marian \
    --output "$OUT/gpu_speed_base.json" 2>&1 | grep -v Warning
echo "speed rc=${PIPESTATUS[0]}"
