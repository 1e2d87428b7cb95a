# GPT-2 small sized RoFormer (124M parameters with a 50k vocabulary) for a large corpus on
# GPUs. Build the corpus first, e.g.
#   python data/text/prepare.py --input /path/to/corpus/*.txt --out_dir data/mytext --vocab_size 50304
# then, on one node with 8 GPUs:
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py --dataset=mytext
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
