# The default: `python train.py config/small.py`. A small RoFormer on the pystdlib corpus
# (built from this Python's standard library on first use) that trains in under 10 minutes
# on a 2-core CPU and clearly learns. On a GPU it finishes in well under a minute.
out_dir = "out-small"
dataset = "pystdlib"
eval_interval = 100
eval_iters = 10

batch_size = 16
block_size = 128
gradient_accumulation_steps = 1
n_layer = 4
n_head = 4
n_embd = 256
dropout = 0.0

learning_rate = 2e-3
max_iters = 600
lr_decay_iters = 600
warmup_iters = 50
min_lr = 2e-4
weight_decay = 0.1
