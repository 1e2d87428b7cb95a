"""
Train a RoFormer language model. One script for a laptop CPU and for a GPU cluster.

    python train.py config/small.py                       # one process, device picked for you
    python train.py config/small.py --batch_size=8 --compile=False
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py   # DDP, one node
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py --fsdp=True  # sharded

Configuration: the module-level variables below are the defaults; config files (plain Python)
and then --key=value arguments override them (configurator.py). Every field of RoFormerConfig
is a key of its own.

Determinism, which exact resume and DDP rest on: the batch of a micro-step is a pure function
of (seed, iteration, global micro-step), with global micro-step = rank * G/N + local micro-step
for N ranks and gradient accumulation G, drawn from a generator of its own; dropout is seeded
the same way. So a resumed run replays exactly the batches an unbroken run would have seen,
N ranks see the batches of one process, and evaluation (its own fixed generator) never
disturbs training.
"""
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import torch

import parallel
from configurator import (ConfigError, configure, cpu_has_bf16, cuda_autocast_dtype, file_sha256,
                          gpu_peak_flops)
from model import RoFormerConfig
from optim import build_optimizer

# ----------------------------------------------------------------------------------------
# defaults
# I/O
out_dir = "out"
dataset = "pystdlib"         # data/<dataset>/: train.bin, val.bin, meta.json, tokenizer.model
data_dir = ""                # "" means data/<dataset> next to this script
init_from = "scratch"        # "scratch" | "resume" (from out_dir/ckpt.pt)
eval_interval = 250          # evaluate, log and checkpoint every this many iterations
eval_iters = 20              # batches per split per evaluation
log_interval = 10            # progress: bar postfix, or one plain line when not on a terminal
# wandb (optional; WANDB_MODE=offline works without a network)
wandb_log = False
wandb_project = "roformer"
wandb_run_name = "run"
# data
batch_size = 16              # sequences per micro-step per process
gradient_accumulation_steps = 1  # micro-steps per optimizer step, over ALL processes
# model: every field of RoFormerConfig (vocab_size 0: take it from the dataset's meta.json)
vocab_size = 0
block_size = 256
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.0
bias = False
rope_base = 10000.0
attention = "softmax"
feature_map = "elu"
pos_encoding = "rope"
linear_chunk = 64
linear_norm = False
rope_scaling = "none"
rope_factor = 1.0
rel_clip, t5_buckets, t5_max_distance = 16, 32, 128  # pos_encoding shaw / t5 only
# AdamW, linear warmup then cosine decay to min_lr at lr_decay_iters
learning_rate = 6e-4
max_iters = 5000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0              # 0 disables clipping
decay_lr = True
warmup_iters = 100
lr_decay_iters = 5000        # the schedule depends on this, never on max_iters (exact resume)
min_lr = 6e-5
# system
device = "auto"              # "auto" | "cpu" | "cuda" | "cuda:1" | "mps"
dtype = "auto"               # "auto" | "float32" | "bfloat16" | "float16"
compile = True               # torch.compile the model (--compile=False always works)
seed = 1337
# under torchrun: shard weights, gradients and optimizer over the ranks with FSDP2 (parallel.py)
fsdp = False
activation_checkpointing = False  # recompute each block's activations in backward: less memory

MODEL_KEYS = [f.name for f in dataclasses.fields(RoFormerConfig)]
# Keys that only say how long / how often: they may change on resume without breaking exactness.
LOOP_KEYS = {"max_iters", "eval_interval", "eval_iters", "log_interval", "out_dir", "init_from",
             "wandb_log", "wandb_project", "wandb_run_name", "compile", "device", "fsdp",
             "activation_checkpointing"}
defaults = {k: v for k, v in globals().items() if not k.startswith("_") and k.isidentifier()
            and isinstance(v, (bool, int, float, str)) and k not in ("MODEL_KEYS",)}
assert set(MODEL_KEYS) <= set(defaults), "a RoFormerConfig field has no training config key"
try:
    config = configure(defaults, sys.argv[1:])
except ConfigError as e:
    sys.exit(f"error: {e}")
globals().update(config)


def fail(msg):
    sys.exit(f"error: {msg}")


for _k in ("batch_size", "gradient_accumulation_steps", "eval_interval", "eval_iters",
           "log_interval", "lr_decay_iters"):
    if config[_k] < 1:
        fail(f"{_k} must be >= 1, got {config[_k]}")
if init_from not in ("scratch", "resume"):
    fail(f"init_from must be 'scratch' or 'resume', got {init_from!r}")
if dtype not in ("auto", "float32", "bfloat16", "float16"):
    fail(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
if warmup_iters > lr_decay_iters:
    fail(f"warmup_iters ({warmup_iters}) must not exceed lr_decay_iters ({lr_decay_iters})")
if fsdp and int(os.environ.get("RANK", -1)) == -1:
    fail("fsdp=True shards the model over processes: run under torchrun (--nproc_per_node=1 "
         "works too)")
if fsdp and dtype == "float16":
    fail("fsdp=True supports dtype float32 and bfloat16, not float16")

# ----------------------------------------------------------------------------------------
# processes: torchrun sets RANK/WORLD_SIZE; otherwise a single process
ddp = int(os.environ.get("RANK", -1)) != -1
rank, local_rank, world = 0, 0, 1
if ddp:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if gradient_accumulation_steps % world:
        fail(f"gradient_accumulation_steps ({gradient_accumulation_steps}) must be divisible by "
             f"the number of processes ({world})")
master = rank == 0
local_steps = gradient_accumulation_steps // world  # micro-steps this process runs per iteration

if device == "auto":
    if torch.cuda.is_available():
        device = "cuda"
    elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        device = "mps"
    else:
        device = "cpu"
if ddp and device.startswith("cuda"):
    device = f"cuda:{local_rank}"
device_type = device.split(":")[0]
if device_type == "cuda":
    if not torch.cuda.is_available():
        fail(f"device={device!r} but CUDA is not available")
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for the fp32 matmuls left outside autocast
    torch.backends.cudnn.allow_tf32 = True
if ddp:
    # Rendezvous by hand to prefix the store's keys with the restart count: after a
    # `torchrun --max-restarts` restart, the agent's store still holds the dead workers'
    # addresses, and gloo would sometimes connect to them (refused, or hung) instead of the
    # new ones.
    store, _, _ = next(torch.distributed.rendezvous("env://"))
    store = torch.distributed.PrefixStore(
        f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
    torch.distributed.init_process_group(backend="nccl" if device_type == "cuda" else "gloo",
                                         store=store, rank=rank, world_size=world)


if dtype == "auto":
    if device_type == "cuda":
        dtype = cuda_autocast_dtype()  # bf16 where native, else fp16 (T4, V100)
    elif device_type == "cpu" and cpu_has_bf16():
        # Measured on a 2-core AVX512-BF16 CPU (bench/train.py, quiet machine): bf16 autocast
        # trains config/small.py's model 1.2x faster eager and 1.5x compiled than float32,
        # and reached the same val loss at equal steps (4.509 vs 4.501 after 300 iterations).
        dtype = "bfloat16"
    else:
        dtype = "float32"  # MPS, or a CPU that would only emulate bf16
if dtype == "bfloat16" and device_type == "cpu" and not cpu_has_bf16():
    print("warning: this CPU has no native bf16 matmul; bfloat16 will be emulated and slow")
if dtype == "float16" and device_type != "cuda":
    fail("dtype=float16 needs CUDA (its GradScaler); use bfloat16 or float32")
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
# With FSDP, bf16 is its mixed-precision policy (bf16 weights for compute), not autocast.
autocast = (contextlib.nullcontext() if dtype == "float32" or fsdp
            else torch.autocast(device_type=device_type, dtype=ptdtype))
config.update(device=device, dtype=dtype)  # what actually ran, recorded in the checkpoint

# ----------------------------------------------------------------------------------------
# data
here = os.path.dirname(os.path.abspath(__file__))
ddir = data_dir or os.path.join(here, "data", dataset)
needed = ["train.bin", "val.bin", "meta.json"]
missing = [f for f in needed if not os.path.exists(os.path.join(ddir, f))]
if missing and dataset == "pystdlib" and not data_dir:
    # The default corpus is built from this Python's standard library: no download, so the
    # first command works on a fresh clone. Rank 0 builds it; the others wait at the barrier.
    if master:
        print(f"data/{dataset} not found: building it with data/{dataset}/prepare.py ...",
              flush=True)
        r = subprocess.run([sys.executable, os.path.join(here, "data", dataset, "prepare.py")])
        if r.returncode:
            fail(f"python data/{dataset}/prepare.py failed (exit {r.returncode})")
    if ddp:
        torch.distributed.barrier()
    missing = [f for f in needed if not os.path.exists(os.path.join(ddir, f))]
if missing:
    base = dataset[:-len("_char")] if dataset.endswith("_char") else None
    if os.path.exists(os.path.join(here, "data", dataset, "prepare.py")):
        cmd = f"python data/{dataset}/prepare.py"
    elif base and os.path.exists(os.path.join(here, "data", base, "prepare.py")):
        cmd = f"python data/{base}/prepare.py --char"  # the character-level variant
    else:
        cmd = f"python data/text/prepare.py --input YOUR_FILES --out_dir data/{dataset}"
    fail(f"dataset '{dataset}' not found ({ddir} lacks {', '.join(missing)}); build it with: "
         f"{cmd}")
with open(os.path.join(ddir, "meta.json")) as f:
    meta = json.load(f)
data_dtype = np.dtype(meta["dtype"])


def tokens(split):
    # A fresh memmap per call: numpy keeps pages of a long-lived memmap resident (nanoGPT #268).
    return np.memmap(os.path.join(ddir, f"{split}.bin"), dtype=data_dtype, mode="r")


for _s in ("train", "val"):
    if len(tokens(_s)) < block_size + 1:
        fail(f"{ddir}/{_s}.bin has {len(tokens(_s))} tokens, fewer than block_size+1 = "
             f"{block_size + 1}; lower block_size or use more data")


def get_batch(split, rng, bs, T):
    """bs random windows of T+1 tokens, picked by the numpy Generator `rng`: inputs are the
    first T tokens of a window, targets the last T."""
    data = tokens(split)
    ix = rng.integers(0, len(data) - T, size=bs)  # exclusive bound: the last window is data[-T-1:]
    w = torch.from_numpy(data[ix[:, None] + np.arange(T + 1)].astype(np.int64))
    if device_type == "cuda":
        # Pin and send the whole contiguous window, then slice on the device: pinning a
        # strided view (w[:, :-1]) would go through a pageable temporary copy first.
        w = w.pin_memory().to(device, non_blocking=True)
    else:
        w = w.to(device)
    # contiguous on the device (two tiny copies): strided token ids made the training step
    # ~1% slower at nanoGPT's CPU recipe (bench/train.py --overhead=True)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


tok_path = os.path.abspath(os.path.join(ddir, "tokenizer.model"))
tokenizer = {"dataset": dataset, "data_dir": data_dir, "path": tok_path,
             "sha256": file_sha256(tok_path) if os.path.exists(tok_path) else None,
             "vocab_size": meta["vocab_size"], "eos_id": meta.get("eos_id"),
             "bos_id": meta.get("bos_id")}

# ----------------------------------------------------------------------------------------
# model, optimizer, and the checkpoint to resume from
os.makedirs(out_dir, exist_ok=True)
ckpt_path = os.path.join(out_dir, "ckpt.pt")
log_path = os.path.join(out_dir, "log.jsonl")
restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
# Every run has an id, recorded in its checkpoints. Under torchrun it is the rendezvous id:
# the same on every node and across --max-restarts restarts (--standalone draws a fresh one;
# across nodes pass a unique --rdzv_id, e.g. the SLURM job id). A single process draws its own.
run_id = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex


def load_checkpoint(path):
    try:
        # mmap: every rank reads the metadata; the weights are paged in only where needed
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated, or not a checkpoint: say which file, not a traceback
        fail(f"cannot load {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")


ckpt = None
if init_from == "resume":
    if not os.path.exists(ckpt_path):
        fail(f"init_from=resume but {ckpt_path} does not exist")
    ckpt = load_checkpoint(ckpt_path)
elif restarts > 0 and os.path.exists(ckpt_path):
    # torchrun restarted us after a crash: continue from the last checkpoint, but only if this
    # run wrote it. (A scratch start moved any older checkpoint aside, see below.)
    ckpt = load_checkpoint(ckpt_path)
    if ckpt.get("run_id") == run_id:
        if master:
            print(f"restart {restarts}: resuming from {ckpt_path}", flush=True)
        init_from = "resume"
    else:
        ckpt = None
if init_from == "scratch" and os.path.exists(ckpt_path):
    # A new run never overwrites another run's work, and a restart must not mistake it for its
    # own: move the old checkpoint and its log aside, stamped with the checkpoint's time.
    if ddp:
        torch.distributed.barrier()  # every rank has decided before the file moves
    if master:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(ckpt_path)))
        for name in ("ckpt", "log"):
            ext = ".pt" if name == "ckpt" else ".jsonl"
            old = os.path.join(out_dir, name + ext)
            if os.path.exists(old):
                os.replace(old, os.path.join(out_dir, f"{name}.{stamp}{ext}"))
        print(f"note: {out_dir} held a checkpoint of another run; moved it to "
              f"ckpt.{stamp}.pt (and its log to log.{stamp}.jsonl)", flush=True)
if ckpt is not None:
    model_args = dict(ckpt["model_args"])  # the shape comes from the checkpoint
    differ = [k for k in config if k not in LOOP_KEYS and k not in ("dtype",)
              and k in ckpt["config"] and ckpt["config"][k] != config[k]
              and not (k in MODEL_KEYS and model_args.get(k) == config[k])]
    if master and differ:
        print(f"note: resuming with {', '.join(differ)} changed from the checkpoint's run "
              f"(model keys are taken from the checkpoint; the rest from this command)")
    block_size = model_args["block_size"]
    if ckpt["tokenizer"]["sha256"] != tokenizer["sha256"]:
        fail(f"the checkpoint's tokenizer ({ckpt['tokenizer']['path']}) differs from "
             f"{tok_path}; resume with the same dataset")
else:
    model_args = {k: config[k] for k in MODEL_KEYS}
    if model_args["vocab_size"] == 0:
        model_args["vocab_size"] = meta["vocab_size"]
    elif model_args["vocab_size"] < meta["vocab_size"]:
        fail(f"vocab_size={model_args['vocab_size']} is smaller than the dataset's "
             f"{meta['vocab_size']}")
try:
    mconf = RoFormerConfig(**model_args)
except ValueError as e:
    fail(str(e))
model_args = dataclasses.asdict(mconf)
config.update(model_args)  # the checkpoint records the model that ran, not the command line
# built on the meta device, wrapped (DDP, or FSDP and sharded), then initialised from the seed
raw_model, model, eval_model = parallel.build_model(
    mconf, seed, device, fsdp=fsdp, ddp=ddp, compile=compile,
    param_dtype=ptdtype if fsdp and dtype == "bfloat16" else None,
    activation_checkpointing=activation_checkpointing)
optimizer = build_optimizer(raw_model, learning_rate, weight_decay, (beta1, beta2), device_type)
# fp16 needs loss scaling; bf16 and fp32 do not (the scaler is then a no-op)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16") \
    if device_type == "cuda" else None
iter_num, best_val_loss, tokens_seen = 0, float("inf"), 0
tokens_per_iter = batch_size * block_size * gradient_accumulation_steps  # over all ranks
if ckpt is not None:
    # load_state_dict also brings back the old run's hyperparameters (weight_decay, betas,
    # eps, fused, ...); this command's settings are the ones that must run, so put them back.
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:  # weights and optimizer state, from ckpt.pt or the DCP folder it names
        parallel.load_checkpoint_state(ckpt, ckpt_path, raw_model, optimizer)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    for group, kept in zip(optimizer.param_groups, settings):
        group.update(kept)
    if scaler is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
    # a resumed run may use another batch size: count the tokens, not iterations x batch
    tokens_seen = ckpt.get("tokens", iter_num * tokens_per_iter)
    rs = ckpt["rng"]  # batches and dropout are reseeded every micro-step; restored anyway
    torch.set_rng_state(rs["torch"])
    np.random.set_state(tuple(rs["numpy"]))
    random.setstate((rs["python"][0], tuple(rs["python"][1]), rs["python"][2]))
    del ckpt
start_iter = iter_num
resumed = init_from == "resume"


def get_lr(it):
    """Linear warmup, then cosine from learning_rate to min_lr at lr_decay_iters, then flat."""
    if not decay_lr:
        return learning_rate
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss():
    """Mean loss on eval_iters fixed batches per split. Its generator is rebuilt from the seed
    every time, so every evaluation sees the same batches and no training RNG is consumed."""
    out = {}
    eval_model.eval()
    for i, split in enumerate(("train", "val")):
        rng = np.random.default_rng([seed, 7919, i])
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            x, y = get_batch(split, rng, batch_size, block_size)
            with autocast:
                losses[k] = eval_model(x, y)[1].float()
        out[split] = losses.mean().item()
    eval_model.train()
    return out


def save_checkpoint():
    """Atomic (parallel.py): the run's state goes to ckpt.pt.tmp (and a DCP folder with FSDP),
    then renamed over ckpt.pt, so a crash never leaves half a checkpoint. All ranks call it."""
    npst = np.random.get_state()
    ck = {"scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
          "iter_num": iter_num, "best_val_loss": best_val_loss, "tokens": tokens_seen,
          "run_id": run_id, "model_args": model_args, "config": config, "tokenizer": tokenizer,
          "rng": {"torch": torch.get_rng_state(),
                  "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]),
                            float(npst[4])],
                  "python": list(random.getstate())}}
    parallel.save_checkpoint(ckpt_path, ck, raw_model, optimizer)


def peak_flops():
    """FLOP/s of ONE device (this process's) that MFU is measured against. GPU: the datasheet's
    dense bf16/fp16 rate where we know the card (None otherwise). CPU: a 1024^3 matmul in the
    run's dtype, timed now, on this process's threads (a CPU has no honest datasheet number)."""
    if device_type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name())
    if device_type != "cpu":
        return None
    a = torch.randn(1024, 1024, dtype=ptdtype)
    a @ a  # warm up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        a @ a
        n += 1
    return 2 * 1024 ** 3 * n / (time.perf_counter() - t0)


peak = peak_flops()
flops_per_token = raw_model.flops_per_token(block_size)

# ----------------------------------------------------------------------------------------
# logging
if init_from == "scratch" and master:
    open(log_path, "w").close()  # a new run: a new log (an older run's was moved aside)
elif master and os.path.exists(log_path):
    # Drop evaluations logged after the checkpoint (a crash between the two): the resumed run
    # logs them again.
    with open(log_path) as f:
        kept = [ln for ln in f if ln.strip() and json.loads(ln)["iter"] <= start_iter]
    with open(log_path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(log_path + ".tmp", log_path)
if wandb_log and master:
    import wandb
    wandb.init(project=wandb_project, name=wandb_run_name, config=config, dir=out_dir)
if master:
    print(f"{raw_model.num_params() / 1e6:.2f}M parameters, {device} {dtype}, "
          f"compile={compile}, {world} process(es){' (fsdp)' if fsdp else ''}, "
          f"{tokens_per_iter:,} tokens/iter, "
          f"data {ddir}, run {run_id[:8]}", flush=True)
    print("MFU: " + (f"against {peak / 1e12:.3g} TFLOP/s per process" if peak else "n/a "
                     "(peak FLOP/s of this device unknown)"), flush=True)

stop = signalled = False


def on_signal(signum, frame):
    # Finish the step in flight, save, exit 0. A second signal stops at once.
    global stop
    stop = True
    signal.signal(signum, signal.SIG_DFL)


signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
# Test-only crash hook: ROFORMER_CRASH_AT="iter:rank" kills that rank hard at that iteration on
# the first attempt under torchrun, so tests can check --max-restarts resumes exactly.
crash_at = os.environ.get("ROFORMER_CRASH_AT")
crash_at = tuple(map(int, crash_at.split(":"))) if crash_at else None

# ----------------------------------------------------------------------------------------
# the loop
from tqdm import tqdm  # noqa: E402

# A bar on a terminal; under a pipe or a file (CI, SLURM, `> log`) one plain line per
# log_interval instead: a bar's carriage-return updates would write megabytes there.
interactive = sys.stderr.isatty()
bar = tqdm(total=max_iters, initial=iter_num, disable=not master or not interactive,
           dynamic_ncols=True, unit="it")
t_start = time.time()
tok_s = None


def evaluate():
    """Rank 0 evaluates and logs; with FSDP every rank runs the (collective) forwards."""
    global best_val_loss
    if not (master or fsdp):
        return
    losses = estimate_loss()
    if not master:
        return
    best_val_loss = min(best_val_loss, losses["val"])
    rec = {"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"],
           "lr": get_lr(iter_num), "tokens": tokens_seen,
           "time_s": round(time.time() - t_start, 3)}
    with open(log_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    bar.write(f"iter {iter_num}: train {losses['train']:.4f}, val {losses['val']:.4f}")
    if wandb_log:
        wandb.log({"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"],
                   "lr": rec["lr"], "tokens": rec["tokens"]}, step=iter_num)


while iter_num < max_iters:
    # evaluate + checkpoint (not at the iteration a resumed run starts from: already done)
    if iter_num % eval_interval == 0 and not (resumed and iter_num == start_iter):
        evaluate()
        if iter_num > 0:
            save_checkpoint()
    if crash_at and crash_at == (iter_num, rank) and restarts == 0:
        os._exit(17)

    t0 = time.time()
    lr = get_lr(iter_num)
    for g in optimizer.param_groups:
        g["lr"] = lr * g["lr_scale"]
    loss_sum = torch.zeros((), device=device)
    for micro in range(local_steps):
        gstep = rank * local_steps + micro  # the global micro-step: same batches for any N
        rng = np.random.default_rng([seed, iter_num, gstep])
        x, y = get_batch("train", rng, batch_size, block_size)
        if mconf.dropout > 0:  # dropout, also a function of the step; the step's only
            # randomness, so without it no reseed: torch.manual_seed seeds every backend
            # (~0.5 ms a call on CPU, 1-2% of a small model's step)
            torch.manual_seed(int(rng.integers(2 ** 62)))
        last = micro == local_steps - 1
        with parallel.grad_sync(model, last):  # DDP all-reduces on the last micro-step only
            with autocast:
                loss = model(x, y)[1]
            loss_sum += loss.detach()
            # mean over this rank's micro-steps; DDP/FSDP average over the N ranks: 1/G overall
            loss = loss / local_steps
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
    # one sync per step: stop together, and never step on a non-finite loss
    flags = torch.tensor([float(not torch.isfinite(loss_sum)), float(stop)], device=device)
    if ddp:
        torch.distributed.all_reduce(flags)
    if flags[0] > 0:
        bar.close()
        fail(f"non-finite loss at iteration {iter_num}; stopping without saving "
             f"(the last good checkpoint, if any, is {ckpt_path})")
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = parallel.clip_grad_norm(raw_model, grad_clip)  # over all ranks' gradients
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    tokens_seen += tokens_per_iter

    dt = time.time() - t0
    if master and (iter_num % log_interval == 0 or iter_num == max_iters):
        # tokens/s smoothed over steps; the first steps (compilation) are skipped
        rate = tokens_per_iter / dt
        if iter_num - start_iter > 2:
            tok_s = rate if tok_s is None else 0.9 * tok_s + 0.1 * rate
        post = {"loss": f"{loss_sum.item() / local_steps:.4f}", "gnorm": f"{grad_norm.item():.3f}"}
        if tok_s:
            post["tok/s"] = f"{tok_s:,.0f}"  # all ranks together
            # model FLOPs per second of one device over that device's peak
            post["mfu"] = f"{100 * flops_per_token * tok_s / world / peak:.1f}%" if peak \
                else "n/a"
        if interactive:
            bar.set_postfix(post, refresh=False)
        else:
            per_iter = (time.time() - t_start) / (iter_num - start_iter)
            eta = int(per_iter * (max_iters - iter_num))
            print(f"iter {iter_num}/{max_iters}: " + ", ".join(f"{k} {v}" for k, v in post.items())
                  + f", eta {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}", flush=True)
    bar.update(1)
    if flags[1] > 0:
        bar.write(f"signal received: stopping at iteration {iter_num}")
        signalled = True
        break

# The final state is always saved and evaluated once. After a signal, save first: torchrun
# kills 30 s after SIGTERM (SLURM and Kubernetes grace periods are similar), and an evaluation
# alone can take longer than that.
if signalled:
    save_checkpoint()
if iter_num > start_iter or not resumed:
    evaluate()
save_checkpoint()
bar.close()
if wandb_log and master:
    wandb.finish()
if ddp:
    torch.distributed.barrier()  # nobody leaves before rank 0 has saved
    torch.distributed.destroy_process_group()
    # Everything is written (checkpoint renamed, log and wandb closed), so leave without the
    # interpreter's finalization: the DDP/FSDP wrapper still holds the process group, and
    # tearing down gloo's worker threads during finalization sometimes aborts (SIGABRT,
    # "terminate called without an active exception"), so torchrun would report a finished
    # run as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
