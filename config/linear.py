# config/small.py with linear attention (RoFormer eq. 19) in place of softmax; everything
# else is the same run, so the two log.jsonl files compare directly:
#   python train.py config/linear.py
out_dir = "out-linear"
dataset = "pystdlib"
eval_interval = 100
eval_iters = 10

batch_size = 16
block_size = 256
gradient_accumulation_steps = 1
n_layer = 4
n_head = 4
n_embd = 256
dropout = 0.0
attention = "linear"
feature_map = "elu"   # phi(x) = elu(x) + 1, non-negative so the denominator stays positive
linear_chunk = 64
linear_norm = False   # True: RMS-normalise each head's output (eq. 19's weights do not sum to 1)

learning_rate = 2e-3   # a small model tolerates a high rate; warmup keeps the start stable
max_iters = 500
lr_decay_iters = 500
warmup_iters = 40
min_lr = 2e-4
weight_decay = 0.1

# dtype and device are left to train.py's auto choice (bf16 autocast on CPUs with native
# bf16, float32 on the rest). compile: ~50 s up front on a 2-core CPU, then 1.2-1.25x faster
# steps (bench/train.py), so it pays for itself within this run.
compile = True
