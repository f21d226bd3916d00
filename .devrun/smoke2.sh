#!/bin/bash
source .device/setup.sh > $OUT/setup.log 2>&1
export CUDA_DEVICE_MAX_CONNECTIONS=1 TRITON_CACHE_AUTOTUNING=1
COMMON="--sft --mock-data --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --train-iters 12 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --bf16 --position-embedding-type rope --disable-bias-linear --no-gradient-accumulation-fusion --normalization RMSNorm --swiglu --tokenizer-type NullTokenizer --vocab-size 1024 --eval-iters 0 --log-interval 1 --seed 1234 --hidden-dropout 0 --attention-dropout 0 --mock-doc-length-median 128 --no-check-for-nan-in-loss-and-grad --rerun-mode disabled"
GPT="--num-layers 4 --hidden-size 512 --num-attention-heads 8"
HYB="--hybrid-layer-pattern M-M*-M*- --hidden-size 512 --num-attention-heads 8 --mamba-num-heads 16"
MOE="--num-experts 8 --moe-router-topk 2 --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01"
G="--cuda-graph-max-packed-seqs 32 --cuda-graph-warmup-steps 2"
run() { # name gpus script args...
  local name=$1 gpus=$2 script=$3; shift 3
  local n=$(echo $gpus | tr ',' '\n' | wc -l)
  CUDA_VISIBLE_DEVICES=$gpus timeout 300 torchrun --nproc-per-node $n --master-port $((29500+${gpus:0:1})) $script $COMMON "$@" --metrics-file $OUT/logs/$name.jsonl > $OUT/logs/$name.log 2>&1
  echo "$name rc=$?" >> $OUT/logs/summary.txt
}
mkdir -p $OUT/logs
( run gpt_eager 0 pretrain_gpt.py $GPT --cuda-graph-impl none
  run gpt_full 0 pretrain_gpt.py $GPT --cuda-graph-impl full_iteration $G --optimizer-cuda-graph
  run gpt_te 0 pretrain_gpt.py $GPT --cuda-graph-impl transformer_engine $G
  run gpt_chunk_check 0 pretrain_gpt.py $GPT --cuda-graph-impl local --cuda-graph-granularity chunk $G --cuda-graph-check-interval 4
  run gpt_tefree 0 pretrain_gpt.py $GPT --cuda-graph-impl local $G --attention-backend local
  run gpt_ckpt_a 0 pretrain_gpt.py $GPT --train-iters 6 --lr-decay-iters 12 --save $OUT/ckpt --save-interval 6
  run gpt_ckpt_b 0 pretrain_gpt.py $GPT --lr-decay-iters 12 --load $OUT/ckpt --save-interval 100
  run gpt_eval 0 pretrain_gpt.py $GPT --cuda-graph-impl local $G --eval-iters 2 --eval-interval 5 ) &
( run hyb_full 1 pretrain_mamba.py $HYB --cuda-graph-impl full_iteration $G --optimizer-cuda-graph
  run moe_eager 1 pretrain_gpt.py $GPT $MOE --cuda-graph-impl none
  run moe_local 1 pretrain_gpt.py $GPT $MOE --cuda-graph-impl local $G
  run moe_rerun 1 pretrain_gpt.py $GPT $MOE --cuda-graph-impl local $G --moe-capacity-overflow rerun ) &
wait
run gpt_pp2 0,1 pretrain_gpt.py $GPT --pipeline-model-parallel-size 2 --cuda-graph-impl local $G
run gpt_tp2 0,1 pretrain_gpt.py $GPT --tensor-model-parallel-size 2 --sequence-parallel --cuda-graph-impl local $G
cat $OUT/logs/summary.txt
rm -rf $OUT/ckpt/iter_*/  2>/dev/null; ls $OUT/ckpt 2>/dev/null
for f in $OUT/logs/*.log; do echo "== $f"; grep -E "Error|error:|iteration +12/" $f | cut -c1-300 | head -4; done
tar czf $OUT/logs.tgz -C $OUT logs; rm -rf $OUT/logs
