# GPT-2 small sized RoFormer (124M parameters at a 50k vocabulary, 110M at the 32k one below)
# for a large corpus on GPUs. The recipe (README, "A real corpus"): download FineWeb-Edu's
# parquet shards yourself, e.g.
#   huggingface-cli download HuggingFaceFW/fineweb-edu --repo-type dataset \
#       --include "sample/10BT/*.parquet" --local-dir fineweb-edu
# build the dataset (streams, every core; 10M validation tokens instead of 5%):
#   python data/text/prepare.py --input fineweb-edu/sample/10BT --out_dir data/fineweb_edu \
#       --vocab_size 32768 --sample_bytes 100000000 --val_tokens 10000000
# then, on one node with 8 GPUs:
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py --dataset=fineweb_edu
# 0.5M tokens per step: 12 sequences x 1024 tokens x 40 micro-steps, split across the ranks
# (gradient_accumulation_steps counts micro-steps over ALL ranks, so it must divide by N).
out_dir = "out-gpt2-124m"
dataset = "mytext"
eval_interval = 1000
eval_iters = 200
log_interval = 10

batch_size = 12
block_size = 1024
gradient_accumulation_steps = 40
vocab_size = 0          # from the dataset's meta.json
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0

learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
warmup_iters = 2000
min_lr = 6e-5
weight_decay = 0.1
grad_clip = 1.0

compile = True          # pays on GPU
dtype = "auto"          # bf16 autocast where supported, else fp16 with a GradScaler
