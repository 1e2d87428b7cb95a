"""What train.py does before its first step, in the order it must happen: every config value
checked by its rule (`check`), the processes and the device (`place`), then the data, out_dir
and the checkpoint to start from (`open_run`). Each refuses a mistake in one line before
anything is allocated or written, and each writes what it resolved back into the config
(device, dtype, compile, data_dir, the model's keys), so that train.py binds every value once,
as it will run, and the checkpoint records the run that ran."""
import contextlib
import dataclasses
import os
import sys

import torch

import optim
from harness import memory, mfu, out_dir, run_log, run_tokenizer
from harness.common import UserError
from harness.dataset import Splits, check_split_sizes, open_dataset
from harness.device import cxx_compiler_found, native_bf16, pick_device, pick_threads, placed
from harness.flags import check_seed
from model import RoFormerConfig

# 0 is meaningful for the second group (max_iters 0: evaluate the start; eval_interval 0: the end)
RULES = [(("batch_size", "gradient_accumulation_steps", "eval_iters", "log_interval",
           "lr_decay_iters"), lambda v: v >= 1, ">= 1"),
         (("max_iters", "eval_interval", "warmup_iters", "learning_rate", "min_lr", "muon_lr",
           "weight_decay", "grad_clip", "short_iters"), lambda v: v >= 0, ">= 0"),
         (("beta1", "beta2", "muon_momentum"), lambda v: 0 <= v < 1, "in [0, 1)"),
         (("cooldown",), lambda v: 0 <= v <= 1, "in [0, 1] (0: cosine)")]


def check(c, model_keys):
    """The rules of the training keys, and the model's own (RoFormerConfig) on the flags as
    given: a mistake must not wait until out_dir has been prepared."""
    for keys, ok, rule in RULES:
        for key in (k for k in keys if not ok(c[k])):
            raise UserError(f"{key} must be {rule}, got {c[key]}")
    if c["decay_lr"] and 0 < c["learning_rate"] < c["min_lr"]:  # 0: a probe freezing AdamW's part
        raise UserError(f"min_lr ({c['min_lr']}) must not exceed learning_rate "
                        f"({c['learning_rate']}): the rate would rise while it decays; lower "
                        f"--min_lr as well")
    check_seed(c["seed"])
    if not c["init_from"]:
        raise UserError("init_from must be 'scratch', 'resume' or a run folder or checkpoint file")
    if c["warmup_iters"] > c["lr_decay_iters"]:
        raise UserError(f"warmup_iters ({c['warmup_iters']}) must not exceed lr_decay_iters "
                        f"({c['lr_decay_iters']})")
    one_line(optim.check, c["optimizer"], c["fsdp"])
    as_given = {k: c[k] for k in model_keys}
    one_line(RoFormerConfig, **dict(as_given, vocab_size=c["vocab_size"] or 1))


def one_line(fn, *args, **kwargs):
    """fn(*args, **kwargs), the core's refusal (a ValueError: optim.py, model_checks.py) as
    the one line a user sees."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        raise UserError(str(e)) from None


@dataclasses.dataclass
class Processes:
    """This process among the run's, on its device (`place`'s answer)."""
    ddp: bool              # under torchrun (RANK set): DDP, or FSDP with fsdp=True
    rank: int              # this process's rank among `world` (0 without torchrun)
    world: int             # the number of processes
    master: bool           # rank 0: the one that prints, logs and saves
    dev: torch.device      # this process's device (cuda:LOCAL_RANK under torchrun)
    autocast: object       # the step's autocast (a nullcontext in float32 or with FSDP)
    bf16: bool             # whether the device multiplies bf16 natively (the optimizers ask)
    threads: int           # the CPU threads torch runs with
    threads_note: object   # why fewer threads than cores (a busy CPU), or None


@dataclasses.dataclass
class Run:
    """The run opened before the model (`open_run`'s answer): data, identity, checkpoint."""
    ddir: str              # the dataset folder read
    meta: dict             # its meta.json (vocab_size, dtype of the .bin files, eos/bos ids)
    splits: Splits         # train.bin and val.bin, checked again at every evaluation
    tokenizer: dict        # the tokenizer's identity the checkpoint records (run_tokenizer.py)
    run_id: str            # one id for the run across resumes and torchrun restarts
    ckpt: object           # init_from=resume's checkpoint (dropped once loaded), or None
    source: object         # init_from=RUN's checkpoint (dropped once loaded), or None
    source_path: str       # init_from as given: scratch, resume, or RUN's folder
    mconf: RoFormerConfig  # the model that runs (on resume, the checkpoint's)
    resumed: bool          # whether the run continues a checkpoint of its own


def place(c):
    """The processes (torchrun sets RANK/WORLD_SIZE; otherwise one), this one's device and
    dtype, its autocast, whether it multiplies bf16 natively, and its CPU threads. Sets c's
    device, dtype and compile to what runs."""
    ddp = int(os.environ.get("RANK", -1)) != -1
    if c["fsdp"] and not ddp:
        raise UserError("fsdp=True shards the model over processes: run under torchrun "
                        "(--nproc_per_node=1 works too)")
    rank, local_rank, world = 0, 0, 1
    if ddp:
        from harness import parallel  # only under torchrun: one process needs no torch.distributed
        rank, local_rank, world = parallel.ranks(c["gradient_accumulation_steps"])
    if c["wandb_log"] and rank == 0:
        from harness import wandb_run  # only when asked for
        wandb_run.check()
    dev, dtype = pick_device(c["device"], c["dtype"], training=True)
    if c["fsdp"] and dtype == "float16":
        raise UserError("fsdp=True supports dtype float32 and bfloat16, not float16")
    dtype = one_line(optim.training_dtype, c["optimizer"], dtype, c["dtype"])
    # one GPU per process, named (cuda:LOCAL_RANK under torchrun, else a bare cuda is cuda:0)
    dev = parallel.init_process_group(dev, rank, local_rank, world) if ddp else placed(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 matmuls left outside autocast
        torch.backends.cudnn.allow_tf32 = True
    # With FSDP, bf16 is its mixed-precision policy (bf16 weights for compute), not autocast.
    autocast = (contextlib.nullcontext() if dtype == "float32" or c["fsdp"]
                else torch.autocast(device_type=dev.type, dtype=getattr(torch, dtype)))
    if dev.type == "cpu" and dtype == "bfloat16" and c["block_size"] <= 128:
        # SDPA's CPU flash kernel in bf16 is slower than the plain product (math) at short
        # windows, its backward most (SPEED.md, "attention on a CPU in bf16"); the flag is
        # torch's global one, read by the CPU's choice of kernel as well as CUDA's
        torch.backends.cuda.enable_flash_sdp(False)
    compile = c["compile"]
    if compile and dev.type == "cpu" and not cxx_compiler_found():
        if rank == 0:
            print("warning: compile=True needs a C++ compiler on the CPU ($CXX, or g++) and "
                  "there is none: running eager (pass --compile=False to skip this check)",
                  flush=True)
        compile = False
    c.update(device=str(dev), dtype=dtype, compile=compile)  # what ran, in the checkpoint
    threads, threads_note = pick_threads(dev.type)  # fewer on a busy CPU (device.py: why)
    return Processes(ddp=ddp, rank=rank, world=world, master=rank == 0, dev=dev,
                     autocast=autocast, bf16=native_bf16(dev.type), threads=threads,
                     threads_note=threads_note)


def open_run(c, given, model_keys, loop_keys, p):
    """The dataset, the tokenizer's identity, out_dir (locked by rank 0; another run's
    checkpoint moved aside) and the checkpoint to start from: init_from=resume or a torchrun
    restart of this very run (never another run's checkpoint), or init_from=RUN's weights.
    Sets c's data_dir, vocab_size and model keys to the model that runs (on resume, the
    checkpoint's). Exits when a resumed run has nothing left to train."""
    run_id, restarts = out_dir.run_identity()
    if c["init_from"] != "scratch" or restarts:
        from harness import resume  # only when starting from a checkpoint
    ckpt = (resume.find(c["out_dir"], c["init_from"] == "resume", run_id, restarts, p.master)
            if c["init_from"] == "resume" or restarts else None)
    if ckpt is not None:  # without --dataset and --data_dir: the dataset the run read
        resume.recorded_dataset(ckpt, c, given)
    ddir, meta = open_dataset(c["dataset"], c["data_dir"], p.master, p.ddp,
                              named="dataset" in given or ckpt is not None)
    tokenizer = run_tokenizer.tokenizer_identity(c["dataset"], c["data_dir"], ddir, meta)
    c["data_dir"] = os.path.abspath(ddir)  # the folder read: eval.py --split and export use it
    source = None  # init_from=RUN: RUN's checkpoint, checked before out_dir is touched
    if c["init_from"] not in ("scratch", "resume"):
        source, source_args = resume.continue_from(c["init_from"], c, model_keys, tokenizer,
                                                   c["out_dir"], given, p.master)
        c.update(source_args, init_from=os.path.abspath(c["init_from"]))
    if c["vocab_size"] == 0:  # recorded as resolved, so a resume with the same flags agrees
        c["vocab_size"] = meta["vocab_size"]
    out_dir.check_apart_from_data(c["out_dir"], ddir)
    out_dir.prepare_out_dir(c["out_dir"], p.master)  # rank 0 locks it for the run
    if ckpt is not None:
        model_args = dict(ckpt["model_args"])  # the shape comes from the checkpoint
        resume.check(ckpt, c, tokenizer, loop_keys, p.master)
        run_id = ckpt.get("run_id") or run_id  # the same run, continued: one id
        exit_if_done(ckpt["iter_num"], c["max_iters"], p)
    else:
        out_dir.move_aside(c["out_dir"], p.master, p.ddp)  # another run's checkpoint stays
        model_args = {k: c[k] for k in model_keys}
    if model_args["vocab_size"] < meta["vocab_size"]:
        raise UserError(f"vocab_size={model_args['vocab_size']} is smaller than the dataset's "
                        f"{meta['vocab_size']}")
    mconf = one_line(RoFormerConfig, **model_args)
    c.update(dataclasses.asdict(mconf))  # the checkpoint records the model that ran
    memory.check_fits(memory.training_memory(mconf, c["batch_size"], p.world if c["fsdp"] else 1,
                                       c["activation_checkpointing"]), p.dev)  # before allocating
    check_split_sizes(ddir, meta, mconf.block_size)  # the block_size that runs: on resume, ckpt's
    return Run(ddir=ddir, meta=meta, splits=Splits(ddir, meta), tokenizer=tokenizer,
               run_id=run_id, ckpt=ckpt, source=source, source_path=c["init_from"], mconf=mconf,
               resumed=ckpt is not None)


def exit_if_done(iter_num, max_iters, p):
    """A resumed run with nothing left to train says so, writes nothing and exits 0."""
    if iter_num < max_iters:
        return
    if p.master:
        print(f"note: the checkpoint is at iteration {iter_num}, max_iters={max_iters}: nothing "
              f"to train (raise --max_iters)", flush=True)
    if p.ddp:
        from harness import parallel
        parallel.finish()  # exits once every rank is here
    sys.exit(0)


def load_checkpoint(run, ckpt_path, raw_model, optimizer, scaler, tokens_per_iter, master):
    """(iteration, best val loss, tokens seen, wandb id, seconds run) where the run starts: a
    resumed run's (its weights, optimizer, scaler and RNGs loaded), or iteration 0 with RUN's
    weights only (init_from=RUN: a fresh optimizer and schedule), or from scratch. Drops run's
    checkpoint."""
    ckpt, source, run.ckpt, run.source = run.ckpt, run.source, None, None
    if ckpt is None and source is None:
        return 0, float("inf"), 0, None, 0.0
    from harness import resume  # only when starting from a checkpoint
    if ckpt is not None:
        return resume.restore(ckpt, ckpt_path, raw_model, optimizer, scaler, tokens_per_iter,
                              master)
    resume.load_weights(raw_model, source["model"], run.source_path)
    return 0, float("inf"), 0, None, 0.0


def first_lines(c, p, run, log_path, n_params, tokens_per_iter, peak, start_iter):
    """Rank 0, before the first step: log.jsonl (new, or cut back to the checkpoint), the run's
    copy of its tokenizer (sample, eval and export then need no dataset folder), and what
    decides the run's speed and quality, first."""
    if run.resumed:
        from harness.resume import repair_log
        repair_log(log_path, start_iter)
    else:
        run_log.new_log(log_path)
    out_dir.keep_tokenizer(c["out_dir"], run.tokenizer)
    if p.threads_note:
        print(p.threads_note, flush=True)
    on = f", {p.threads} thread{'s' * (p.threads > 1)}" if p.dev.type == "cpu" else ""
    print(f"{n_params / 1e6:.2f}M parameters, {c['device']} {c['dtype']}{on}, optimizer="
          f"{c['optimizer']}, compile={c['compile']}, {p.world} process(es)"
          f"{' (fsdp)' if c['fsdp'] else ''}, {tokens_per_iter:,} tokens/iter, data "
          f"{run.ddir}, run {run.run_id[:8]}", flush=True)
    print("MFU: " + (f"against {peak / 1e12:.3g} TFLOP/s per process" if peak else
                     mfu.CPU_NO_PEAK if p.dev.type == "cpu" else
                     "n/a (peak FLOP/s of this device unknown)"), flush=True)
    if c["compile"]:  # the first forward compiles, silently: 57 s before any line on a CPU
        print("compile=True: the first evaluation and the first steps wait while torch.compile "
              "builds the model's kernels (a minute or more on a CPU, less once cached; "
              "--compile=False skips it)", flush=True)
