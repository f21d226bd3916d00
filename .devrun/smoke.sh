#!/bin/bash
# Upstream-loop smoke: GPT and hybrid, eager vs graphs, on one GPU each.
source .device/setup.sh > $OUT/setup.log 2>&1
export CUDA_DEVICE_MAX_CONNECTIONS=1
COMMON="--sft --mock-data --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --train-iters 12 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --bf16 --position-embedding-type rope --disable-bias-linear --no-gradient-accumulation-fusion --normalization RMSNorm --swiglu --tokenizer-type NullTokenizer --vocab-size 1024 --eval-iters 0 --log-interval 1 --seed 1234 --hidden-dropout 0 --attention-dropout 0 --mock-doc-length-median 128 --no-check-for-nan-in-loss-and-grad --rerun-mode disabled"
GPT="--num-layers 4 --hidden-size 512 --num-attention-heads 8"
HYB="--hybrid-layer-pattern M-M*-M*- --hidden-size 512 --num-attention-heads 8 --mamba-num-heads 16"
run() { # name gpu script args...
  local name=$1 gpu=$2 script=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout 420 torchrun --nproc-per-node 1 --master-port $((29500+gpu)) $script $COMMON "$@" --metrics-file $OUT/$name.jsonl > $OUT/$name.log 2>&1
  echo "$name rc=$?" >> $OUT/summary.txt
}
( run gpt_eager 0 pretrain_gpt.py $GPT --cuda-graph-impl none
  run gpt_local 0 pretrain_gpt.py $GPT --cuda-graph-impl local --cuda-graph-max-packed-seqs 32 --cuda-graph-warmup-steps 2
  run gpt_full 0 pretrain_gpt.py $GPT --cuda-graph-impl full_iteration --cuda-graph-max-packed-seqs 32 --cuda-graph-warmup-steps 2 --optimizer-cuda-graph ) &
( run hyb_eager 1 pretrain_mamba.py $HYB --cuda-graph-impl none
  run hyb_local 1 pretrain_mamba.py $HYB --cuda-graph-impl local --cuda-graph-max-packed-seqs 32 --cuda-graph-warmup-steps 2 ) &
wait
cat $OUT/summary.txt
for f in $OUT/*.log; do echo "== $f"; grep -E "error|Error|Traceback|packed graphs|iteration +1[02]/" $f | head -8; done
