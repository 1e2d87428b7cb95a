# The length study's task model (docs/CONTEXT.md, bench/studies/length.py): associative recall at a
# training window of 128, read at 4x and 16x it.
#   python data/recall/prepare.py && python train.py config/recall.py
out_dir = "out-recall"
dataset = "recall"
compile = False

n_layer = 2              # the retrieval circuit needs two: a previous-token head, a matching one
n_head = 4
n_embd = 128
block_size = 128
batch_size = 32
doc_aligned = True       # windows start at a document, as the study's prompts do: without it
                         # a needle at a prompt's very start (depth 0) is read worst (LOG.md)
dropout = 0.0

optimizer = "muon"
max_iters = 4000         # recall is learned in a jump, late and at a seed's own iteration
lr_decay_iters = 4000
muon_lr = 0.03
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 30
cooldown = 0.5

eval_interval = 0          # val loss mixes filler and needles: bench/studies/length.py scores
eval_iters = 10
log_interval = 50
