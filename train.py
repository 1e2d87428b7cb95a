"""Train a RoFormer language model. One script for a laptop CPU and for a GPU cluster.

    python train.py config/small.py                       # one process, device picked for you
    python train.py config/small.py --batch_size=8 --compile=False
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py   # DDP, one node
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py --fsdp=True  # sharded

The module-level variables below are the defaults (every field of RoFormerConfig is a key of
its own); config files (plain Python), then --key=value arguments override them.

Determinism, which exact resume and DDP rest on: the batch and the dropout seed of a micro-step
are a pure function of (seed, iteration, global micro-step), with global micro-step =
rank * G/N + local micro-step for N ranks and gradient accumulation G. So a resumed run replays
exactly the batches an unbroken run would have seen, N ranks see the batches of one process,
and evaluation (its own fixed generator) never disturbs training.

Elsewhere: model.py, optim.py (AdamW, Muon), data/; harness/ prepares and guards the run
(start.py: checks, device, data, out_dir, checkpoint, in order; progress_loop.py, checkpoint.py).
"""
import contextlib
import dataclasses
import functools
import math
import os
import sys
import time

import numpy as np
import torch

from harness import checkpoint, common, mfu, progress_waits, run_log, start, stops
from harness.build import build_model
from harness.common import UserError
from harness.dataset import doc_starts
from harness.flags import configure
from harness.progress_loop import Progress
import optim
from model import RoFormerConfig

sys.excepthook = common.excepthook  # a UserError ends as one line `error: ...`, exit 1
common.hold_collections()  # no garbage collection in start-up and exit (common.py: why)

# ----------------------------------------------------------------------------------------
# defaults
# I/O
out_dir = "out"
dataset = "pystdlib"         # data/<dataset>/: train.bin, val.bin, meta.json, tokenizer.model
data_dir = ""                # "" means data/<dataset> next to this script
init_from = "scratch"        # "scratch" | "resume" (out_dir/ckpt.pt) | RUN: fine-tune RUN's weights
eval_interval = 250          # evaluate, log and checkpoint every this many (0: at the end only)
eval_iters = 20              # batches per split per evaluation
log_interval = 10            # progress: bar postfix, or one plain line when not on a terminal
# wandb (optional; WANDB_MODE=offline works without a network)
wandb_log = False
wandb_project = "roformer"
wandb_run_name = "run"
# data
batch_size = 16              # sequences per micro-step per process
gradient_accumulation_steps = 1  # micro-steps per optimizer step, over ALL processes
short_iters = 0              # the first this many iterations on half-length windows (OPTIM.md)
doc_aligned = False          # windows start at an end-of-document token, as prompts do (CONTEXT.md)
# model: every field of RoFormerConfig is a key too, at its default (model.py), except:
vocab_size = 0               # 0: take it from the dataset's meta.json
# optimizer: AdamW, or Muon (optim.py) for the hidden matrices with AdamW for the rest
optimizer = "adamw"          # "adamw" | "muon"
muon_lr = 0.02
muon_momentum = 0.95
learning_rate = 6e-4         # linear warmup, then down to min_lr at lr_decay_iters, by:
cooldown = 0.0               # 0: cosine; f in (0, 1]: the peak, then linear over the last f
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
# under torchrun: shard weights, gradients and optimizer over the ranks with FSDP2
fsdp = False
activation_checkpointing = False  # recompute each block's activations in backward: less memory

MODEL_KEYS = [f.name for f in dataclasses.fields(RoFormerConfig)]
# Keys that only say how long / how often: they may change on resume without breaking exactness.
LOOP_KEYS = {"max_iters", "eval_interval", "eval_iters", "log_interval", "out_dir", "init_from",
             "wandb_log", "wandb_project", "wandb_run_name", "compile", "device", "fsdp",
             "activation_checkpointing", "dtype"}
defaults = {**dataclasses.asdict(RoFormerConfig()), **{
    k: v for k, v in globals().items() if not k.startswith("_") and k.isidentifier()
    and isinstance(v, (bool, int, float, str))}}
given = set()  # the keys the command line and config files set (init_from=RUN keeps the rest)
config = configure(defaults, sys.argv[1:], given, sources=(__file__, "model.py"))  # --help
start.check(config, MODEL_KEYS)  # every value's rule, before anything is touched
procs = start.place(config)      # start.Processes, unpacked below: train.py reads one name each
run = start.open_run(config, given, MODEL_KEYS, LOOP_KEYS, procs)  # start.Run: data, checkpoint
globals().update(config)         # every value as it runs (on resume, the checkpoint's model)
rank, world, master, ddp, dev = procs.rank, procs.world, procs.master, procs.ddp, procs.dev
if ddp:
    from harness import parallel  # only under torchrun: one process needs no torch.distributed
autocast, bf16, ddir, mconf, run_id = procs.autocast, procs.bf16, run.ddir, run.mconf, run.run_id
local_steps = gradient_accumulation_steps // world  # micro-steps this process runs per iteration
ckpt_path, log_path = os.path.join(out_dir, "ckpt.pt"), os.path.join(out_dir, "log.jsonl")


def get_batch(split, rng, bs, T):
    """bs random windows of T+1 tokens picked by `rng`: inputs their first T, targets last T."""
    data = np.memmap(run.splits.files[split], run.meta["dtype"], "r")  # opened at the start
    if doc_aligned:  # from the split's eos positions, found once (harness/dataset.py)
        starts = doc_starts(run.splits.files[split], run.meta["dtype"],
                            run.meta.get("eos_id", -1), T)
        ix = rng.choice(starts, size=bs)
    else:
        ix = rng.integers(0, len(data) - T, size=bs)  # exclusive: the last window is data[-T-1:]
    windows = data[ix[:, None] + np.arange(T + 1)]
    if windows.max() >= mconf.vocab_size:  # on the host, before the embedding would fail
        raise UserError(f"{ddir}/{split}.bin holds token id {windows.max()}, but the model's "
                        f"vocab_size is {mconf.vocab_size}: the data was encoded with another "
                        f"tokenizer; prepare it again with this run's tokenizer")
    w = torch.from_numpy(windows.astype(np.int64))
    # Pin and send the whole contiguous window, then slice on the device: pinning a strided
    # view (w[:, :-1]) would go through a pageable temporary copy first.
    w = w.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else w.to(dev)
    # contiguous on the device (two tiny copies): strided token ids slow the step down
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


# ----------------------------------------------------------------------------------------
# model (built on the meta device, wrapped: DDP or FSDP; initialised from the seed), optimizer
raw_model, model, eval_model = build_model(
    mconf, seed, device, fsdp=fsdp, ddp=ddp, compile=compile,
    param_dtype=torch.bfloat16 if fsdp and dtype == "bfloat16" else None,
    activation_checkpointing=activation_checkpointing)
opt = optim.build_optimizer(raw_model, learning_rate, weight_decay, (beta1, beta2), dev.type,
                            name=optimizer, muon_lr=muon_lr, muon_momentum=muon_momentum,
                            fsdp=fsdp, bf16=bf16)
# fp16 needs loss scaling; bf16 and fp32 do not (a disabled scaler passes everything through)
scaler = torch.amp.GradScaler(dev.type, enabled=dtype == "float16")
tokens_per_iter = batch_size * block_size * gradient_accumulation_steps  # over all ranks
# resume: weights, optimizer, scaler, RNGs and where the run stands; init_from=RUN: RUN's weights
iter_num, best_val_loss, tokens_seen, wandb_id, time_before = start.load_checkpoint(
    run, ckpt_path, raw_model, opt, scaler, tokens_per_iter, master)
resumed, start_iter = run.resumed, iter_num


def lr_factor(it):
    """The schedule as a fraction of a group's base rate (learning_rate for AdamW, muon_lr for
    Muon): linear warmup, then cosine (or cooldown's trapezoid) to min_lr / learning_rate at
    lr_decay_iters, then flat; a fraction, so learning_rate=0 (a probe) leaves Muon's defined."""
    if not decay_lr:
        return 1.0
    if it < warmup_iters:
        return (it + 1) / (warmup_iters + 1)
    floor = min_lr / learning_rate if learning_rate > 0 else 0.0  # then min_lr is 0 as well
    if it >= lr_decay_iters:
        return floor
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    if cooldown:  # flat at the peak, then linear to the floor over the last `cooldown` of it
        return floor + min(1.0, (1.0 - ratio) / cooldown) * (1.0 - floor)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - floor)


def save_checkpoint():
    """Atomic: a crash, a full disk or a power loss never leaves half a checkpoint. All ranks
    call it (an FSDP save is a collective)."""
    save = parallel.save_sharded if fsdp else functools.partial(checkpoint.save, rank=rank)
    save(ckpt_path, {"time_s": time_before + time.time() - progress.t_start,  # resumes too
        "scaler": scaler.state_dict() or None, "run_id": run_id,  # scaler: {} when disabled
        "iter_num": iter_num, "best_val_loss": best_val_loss, "tokens": tokens_seen,
        "wandb_id": wandb_id, "model_args": dataclasses.asdict(mconf), "config": config,
        "tokenizer": run.tokenizer, "rng": checkpoint.rng_state()}, raw_model, opt)


@torch.no_grad()
def evaluate():
    """Mean loss on eval_iters fixed batches per split, logged by rank 0 (with FSDP every rank
    runs the collective forwards). Its generator is rebuilt from the seed every time, so every
    evaluation sees the same batches and no training RNG is consumed."""
    global best_val_loss
    run.splits.check(master and progress.write)  # the data it started with (dataset.py)
    if not (master or fsdp):
        return
    losses = {}
    eval_model.eval()
    batches = progress_waits.bar(total=2 * eval_iters, desc=f"evaluating iteration {iter_num}",
                       unit="batches", shown=master, out=sys.stdout, leave=False, delay=1.0)
    for i, split in enumerate(("train", "val")):
        rng = np.random.default_rng([seed, 7919, i])
        split_losses = torch.zeros(eval_iters, device=dev)  # on the device: one sync per split
        for k in range(eval_iters):
            x, y = get_batch(split, rng, batch_size, block_size)
            with autocast:
                split_losses[k] = eval_model(x, y)[1]
            batches.update()
        losses[split] = split_losses.mean().item()
    batches.close()
    eval_model.train()
    stops.stop_if_diverged(losses, iter_num, ckpt_path, progress)  # never saved, nor called good
    if not master:
        return
    best_val_loss = min(best_val_loss, losses["val"])
    record = {"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"],
              "lr": learning_rate * lr_factor(iter_num), "tokens": tokens_seen,
              "time_s": round(time_before + time.time() - progress.t_start, 3)}
    run_log.append_log(log_path, record, progress.write)
    progress.write(f"iter {iter_num}: train {losses['train']:.4f}, val {losses['val']:.4f}")
    if wandb_log:
        wandb.log({"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"],
                   "lr": record["lr"], "tokens": record["tokens"]}, step=iter_num)


# ----------------------------------------------------------------------------------------
# logging
if wandb_log and master:
    import wandb
    wandb_id = wandb.init(project=wandb_project, name=wandb_run_name, config=config, dir=out_dir,
                          **({"id": wandb_id, "resume": "allow"} if wandb_id else {})).id
peak = mfu.peak_flops(dev.type, dtype)  # of ONE device: MFU is per device
progress = Progress(start_iter, max_iters, tokens_seen,
                    mfu.flops_per_token(mconf, raw_model.num_params(), block_size), peak,
                    world, master, compiled=compile)
if master:
    start.first_lines(config, procs, run, log_path, raw_model.num_params(), tokens_per_iter,
                      peak, start_iter)
stop, stopping = stops.stop_on_signals(), False
common.release_collections()  # and from here on (for what the loop makes)

# ----------------------------------------------------------------------------------------
# the loop
while iter_num < max_iters:
    # evaluate + checkpoint (not at the iteration a resumed run starts from: already done)
    due = eval_interval and iter_num % eval_interval == 0  # eval_interval 0: the end only
    if due and not (resumed and iter_num == start_iter):
        with progress.paused():  # not training time: out of tokens/s
            evaluate()
            if iter_num > 0:
                save_checkpoint()

    for g in opt.param_groups:
        g["lr"] = lr_factor(iter_num) * g["base_lr"]
    loss_sum = torch.zeros((), device=dev)
    T = max(1, block_size // 2) if iter_num < short_iters else block_size  # a cheaper start
    for micro in range(local_steps):
        gstep = rank * local_steps + micro  # the global micro-step: same batches for any N
        rng = np.random.default_rng([seed, iter_num, gstep])
        x, y = get_batch("train", rng, batch_size, T)
        if mconf.dropout > 0:  # dropout, also a function of the step; the step's only
            # randomness, so without it no reseed (torch.manual_seed seeds every backend)
            torch.manual_seed(int(rng.integers(2 ** 62)))
        last = micro == local_steps - 1  # DDP syncs gradients on the last micro-step only
        with parallel.grad_sync(model, last) if ddp else contextlib.nullcontext():
            with autocast:
                loss = model(x, y)[1]
            loss_sum += loss.detach()
            # mean over this rank's micro-steps; DDP/FSDP average over the N ranks: 1/G overall
            scaler.scale(loss / local_steps).backward()
    # one sync per step: stop together, and never step on a non-finite loss
    step_flags = torch.stack([(~torch.isfinite(loss_sum)).float(),
                              torch.tensor(float(bool(stop)), device=dev)])
    if ddp:
        torch.distributed.all_reduce(step_flags)
    non_finite, stopping = step_flags.tolist()
    if non_finite:
        progress.close(iter_num)
        raise UserError(stops.diverged("training step", iter_num, ckpt_path))
    scaler.unscale_(opt)
    # the global gradient norm, over all ranks' gradients; clip to grad_clip (0: no clipping)
    grad_norm = parallel.clip_grad_norm(raw_model, grad_clip) if ddp else \
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip or float("inf"))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    iter_num += 1
    tokens_seen += tokens_per_iter * T // block_size
    if master and (iter_num % log_interval == 0 or iter_num == max_iters):
        progress.log(iter_num, tokens_seen, loss_sum.item() / local_steps, grad_norm.item())
    if stopping:
        if master:
            progress.write(f"signal received: stopping at iteration {iter_num}")
        break

# The final state is always saved and evaluated once; after a signal, save first: torchrun kills
# 30 s after SIGTERM (SLURM and Kubernetes alike), and an evaluation can take longer.
if stopping:
    save_checkpoint()
    if master:
        progress.write(f"saved {ckpt_path} (iteration {iter_num}); continue with "
                       f"{stops.resume_command(sys.argv, ddp)}")
if iter_num > start_iter or not resumed:
    evaluate()
save_checkpoint()
progress.close(iter_num)
if wandb_log and master:
    wandb.finish()
if ddp:
    parallel.finish()  # all ranks wait for rank 0's save, then exit
