# The CPU speedrun: nanoGPT's CPU recipe shape, trained to its 2000-iteration loss in a fraction
# of its time (docs/RECORDS.md: the record, its command, the CPU kinds and how it is timed).
#   python data/shakespeare/prepare.py --char [--input FILE] && python train.py config/speedrun_cpu.py
out_dir = "out-speedrun-cpu"
dataset = "shakespeare_char"
compile = False            # compiling costs more than a run this short would save

# nanoGPT's CPU shape: 4 layers, 4 heads, 128 wide, block 64, batch 12, dropout 0
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
batch_size = 12
dropout = 0.0
# what won in the lab at this budget (docs/LOG.md, 2026-12-07); export.py refuses the value
# residual (no GPT-NeoX or llama.cpp layer mixes in layer 0's values): the record does not export
qk_norm = True
value_residual = True

# the recipe: Muon, a schedule set for its own length, the first iterations on half windows
optimizer = "muon"
max_iters = 375
lr_decay_iters = 375
muon_lr = 0.03
learning_rate = 3e-3       # AdamW's part: embeddings, head, norms
min_lr = 3e-4
warmup_iters = 10
cooldown = 0.5             # the peak held, then a straight line to min_lr over the last half
short_iters = 150

eval_interval = 0          # evaluate once, at the end
eval_iters = 20
log_interval = 25
