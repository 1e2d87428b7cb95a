# The default: `python train.py config/small.py`. A small RoFormer on the pystdlib corpus
# (built from this Python's standard library on first use, no download) that clearly learns
# within minutes on a 2-core CPU, corpus build included, also where the CPU has no native
# bf16 and trains in float32 (docs/SPEED.md has the times per CPU kind).
out_dir = "out-small"
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

# Muon for the blocks' matrices, AdamW (learning_rate) for embeddings, norms and biases: it
# won at equal steps on both corpora tried, every seed (docs/OPTIM.md). --optimizer=adamw for
# the AdamW-only run.
optimizer = "muon"
muon_lr = 0.04
learning_rate = 2e-3   # a small model tolerates a high rate; warmup keeps the start stable
max_iters = 300        # 1.23M tokens
lr_decay_iters = 300
warmup_iters = 30
min_lr = 2e-4
# the peak held, then a straight line to min_lr over the last half: it beat cosine at this
# budget on every seed (docs/LOG.md, 2026-11-28); --cooldown=0 for cosine
cooldown = 0.5
weight_decay = 0.1

# dtype and device are left to train.py's auto choice (bf16 autocast on CPUs with native
# bf16, float32 on the rest). No compile: on a small CPU its start-up cost does not pay back
# within a run this short (docs/SPEED.md). On a GPU, pass --compile=True for longer runs.
compile = False
