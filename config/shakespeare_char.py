# Character-level tiny Shakespeare, beside nanoGPT's shakespeare_char baseline:
#   python data/shakespeare/prepare.py --char && python train.py config/shakespeare_char.py
# nanoGPT's shape (6 layers, 384 wide, 256 context, dropout 0.2). On a GPU this is a few
# minutes; on a 2-core CPU pass e.g. --max_iters=500 for a quick look.
out_dir = "out-shakespeare-char"
dataset = "shakespeare_char"
eval_interval = 250
eval_iters = 200
log_interval = 10

batch_size = 64
block_size = 256
gradient_accumulation_steps = 1
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99          # few tokens per step, so a slightly shorter second-moment memory
warmup_iters = 100
