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

optimizer = "muon"     # as config/small.py
muon_lr = 0.04
learning_rate = 2e-3   # a small model tolerates a high rate; warmup keeps the start stable
max_iters = 300
lr_decay_iters = 300
warmup_iters = 30
min_lr = 2e-4
weight_decay = 0.1

# dtype and device are left to train.py's auto choice, and compile is off, as in small.py
# (it does not pay back within a run this short on a CPU).
compile = False
