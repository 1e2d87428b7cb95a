"""train.py's run operations: the dataset folder, out_dir, run ids, log.jsonl, the progress
line, signals, and the peak FLOP/s that MFU is measured against."""
import contextlib
import json
import os
import platform
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import torch
from tqdm import tqdm

from lib import run_tokenizer
from lib.common import (UserError, atomic_write, created_files, file_sha256,
                        make_out_dir)


def barrier(ddp):
    if ddp:
        torch.distributed.barrier()


# ----------------------------------------------------------------------------------------
# the dataset

def tokenizer_identity(dataset, data_dir, ddir, meta):
    """What the checkpoint records about the tokenizer: sample.py finds the file by it and
    checks it by its sha256 (None for a dataset without tokenizer.model)."""
    path = os.path.abspath(os.path.join(ddir, run_tokenizer.NAME))
    if os.path.exists(path):  # one line now, not a sentencepiece error at the first sample
        run_tokenizer.load(path)
    return {"dataset": dataset, "data_dir": data_dir, "path": path,
            "sha256": file_sha256(path) if os.path.exists(path) else None,
            "vocab_size": meta["vocab_size"], "eos_id": meta.get("eos_id"),
            "bos_id": meta.get("bos_id")}


# ----------------------------------------------------------------------------------------
# out_dir, the run, its checkpoint and log

def run_identity():
    """(run id, restart count). Under torchrun the id is the rendezvous id: the same on every
    node and across --max-restarts restarts (--standalone draws a fresh one; across nodes pass
    a unique --rdzv_id, e.g. the SLURM job id). A single process draws its own."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex, restarts


def prepare_out_dir(out_dir, master=True):
    """Create out_dir and prove now that the run can write there, its log included: an hour of
    training lost to a typo'd path is worse than one line at the start. Rank 0 then holds the
    folder's lock for the whole run."""
    make_out_dir(out_dir)
    if master:
        lock_out_dir(out_dir)
    log_path = os.path.join(out_dir, "log.jsonl")
    try:
        if os.path.lexists(log_path):
            open(log_path, "a").close()
    except OSError as e:
        raise UserError(f"cannot write to out_dir {out_dir}: {e.strerror} ({e.filename})") from None


out_dir_lock = []  # the open lock file: the lock lasts as long as this process


def lock_out_dir(out_dir):
    """Refuse a second run into the same out_dir while one trains there: their logs interleaved
    and each deleted the other's temporary checkpoint. An flock on out_dir/.train.lock, which
    the OS releases when the process ends however it ends (a crash or SIGKILL leaves no stale
    lock); the file holds the pid, for the message. Skipped where there is no fcntl
    (Windows)."""
    try:
        import fcntl
    except ImportError:
        return
    path = os.path.join(out_dir, ".train.lock")
    new = not os.path.exists(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"cannot write to out_dir {out_dir}: {e.strerror} ({path})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if not isinstance(e, BlockingIOError):  # a filesystem without locks: run unlocked
            os.close(fd)
            return
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise UserError(f"out_dir {out_dir} is in use by another training run"
                        f"{f' (pid {holder})' if holder.isdigit() else ''}: wait for it to "
                        f"finish, or pass another --out_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    out_dir_lock.append(fd)
    if new:  # a failed command removes the folder it made, this file included
        created_files.append(path)


def training_memory(mconf, batch_size, shards=1, checkpointing=False):
    """Bytes one training process needs at the least, roughly: 16 per parameter (float32
    weights and gradients, AdamW's two moments; FSDP shards them over `shards` ranks) and one
    micro-batch's float32 activations (about 16 numbers per token and channel in each layer
    kept for backward, 2 with activation checkpointing) and logits with their gradient."""
    d, layers, vocab = mconf.n_embd, mconf.n_layer, mconf.vocab_size
    params = 12 * layers * d * d + vocab * d  # attention 4 d^2, MLP 8 d^2, the tied embedding
    per_token = layers * d * (2 if checkpointing else 16) + 2 * vocab
    return 16 * params // shards + 4 * batch_size * mconf.block_size * per_token


def check_fits(need, dev):
    """Refuse, before anything is allocated, a run that needs more than all of the device's
    memory (the CPU's RAM shared by this machine's ranks; a GPU's total): it would only end
    in the allocator, or swap for minutes first. Only the clearly impossible is refused."""
    if dev.type == "cuda":
        total, where = torch.cuda.mem_get_info(dev)[1], f"on {dev}"
    elif dev.type == "cpu":
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no answer
            return
        procs = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        total, where = total // procs, "of RAM" + (f" per process ({procs} share this "
                                                   f"machine)" if procs > 1 else "")
    else:
        return
    if need > total:
        gib = lambda n: f"{n / 2 ** 30:,.1f} GiB"  # noqa: E731
        raise UserError(f"this model and batch need about {gib(need)} per process, more than "
                        f"the {gib(total)} {where}: lower batch_size (gradient_accumulation_"
                        f"steps keeps the tokens per step), block_size, n_layer or n_embd")


def cxx_compiler_found():
    """Whether torch.compile can build CPU kernels here: inductor compiles them with a C++
    compiler ($CXX, else g++ on Linux and clang++ on macOS) and fails at the first forward,
    with a traceback, where there is none. Asked of inductor itself where this torch has it."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError:  # another torch: look where this one's inductor looks
        default = "clang++" if sys.platform == "darwin" else "g++"
        return shutil.which(os.environ.get("CXX", default)) is not None
    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        return False
    return True


def move_aside(out_dir, master, ddp):
    """A new run never overwrites another run's work, and a restart must not mistake it for its
    own: the old checkpoint and its log move aside, stamped with the checkpoint's time."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.exists(path):
        return
    barrier(ddp)  # every rank has decided before the file moves
    if not master:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(path)))
    for name, ext in (("ckpt", ".pt"), ("log", ".jsonl")):
        old = os.path.join(out_dir, name + ext)
        if os.path.exists(old):
            os.replace(old, os.path.join(out_dir, f"{name}.{stamp}{ext}"))
    print(f"note: {out_dir} held a checkpoint of another run; moved it to "
          f"ckpt.{stamp}.pt (and its log to log.{stamp}.jsonl)", flush=True)


def new_log(log_path):
    """A new run starts an empty log.jsonl (one that crashed before its first checkpoint may
    have left one). The log is not the run's state: failing to write it costs a warning."""
    try:
        open(log_path, "w").close()
    except OSError as e:
        print(f"warning: cannot write {log_path} ({e.strerror}); training goes on", flush=True)


def append_log(log_path, record, warn=print):
    """One line more in log.jsonl. The log is not the run's state: a write that fails (a full
    disk) is cut back off, so no half line is left for the next one to be glued to, and costs
    a warning, not the checkpoint."""
    size = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    try:
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        with contextlib.suppress(OSError):
            os.truncate(log_path, size)
        warn(f"warning: cannot write {log_path} ({e.strerror}): the evaluation at iteration "
             f"{record['iter']} is not logged")


# ----------------------------------------------------------------------------------------
# MFU: model FLOPs per second of one device over that device's peak

# Dense (no sparsity) peaks of one card from the vendors' datasheets, FLOP/s by the dtype that
# runs: bf16/fp16 tensor cores, and for float32 the TF32 tensor-core rate where the card has one
# (train.py allows TF32 matmuls), else plain fp32. The variants of one family differ a lot (H100
# SXM vs PCIe, A10 vs A10G, L40 vs L40S), so names are matched by whole words; an unknown card
# or a dtype the card only emulates (bf16 on a V100 or T4) gets no MFU rather than a wrong one.
GPU_PEAK_FLOPS = {  # (bfloat16, float16, float32)
    ("h200",): (989e12, 989e12, 494.5e12), ("h200", "nvl"): (835e12, 835e12, 417.5e12),
    ("h100",): (989e12, 989e12, 494.5e12), ("h100", "pcie"): (756e12, 756e12, 378e12),
    ("h100", "nvl"): (835e12, 835e12, 417.5e12),
    ("a100",): (312e12, 312e12, 156e12), ("a30",): (165e12, 165e12, 82e12),
    ("a10",): (125e12, 125e12, 62.5e12), ("l4",): (121e12, 121e12, 60e12),
    ("l40",): (181e12, 181e12, 90.5e12), ("l40s",): (362e12, 362e12, 183e12),
    ("v100",): (None, 125e12, 15.7e12), ("v100", "pcie"): (None, 112e12, 14e12),
    ("t4",): (None, 65e12, 8.1e12),
}


def gpu_peak_flops(name, dtype="float16"):
    """Peak FLOP/s of one card from its torch.cuda.get_device_name() for a run in `dtype`, or
    None if unknown. "NVIDIA H100 80GB HBM3" is the SXM part; PCIe and NVL parts say so."""
    words = set(name.lower().replace("-", " ").split())
    keys = [key for key in GPU_PEAK_FLOPS if set(key) <= words]
    if not keys:
        return None
    best = max(keys, key=len)  # the most specific match wins
    return GPU_PEAK_FLOPS[best][("bfloat16", "float16", "float32").index(dtype)]


def peak_flops(device_type, dtype, ddp):
    """FLOP/s of ONE device (this process's) for MFU: a GPU's datasheet peak in the dtype that
    runs, the CPU's timed matmul rate (a CPU has no honest datasheet number), else None."""
    if device_type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(), dtype)
    return cpu_peak_flops(getattr(torch, dtype), ddp) if device_type == "cpu" else None


def time_matmul(dtype, seconds=0.2, bursts=4):
    """FLOP/s of a 1024^3 matmul in `dtype` on this process's threads: the best of a few short
    bursts, so that a moment of load from other processes does not end up in the cache."""
    a = torch.randn(1024, 1024, dtype=dtype)
    a @ a  # warm up
    best = 0.0
    for _ in range(bursts):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / bursts:
            a @ a
            calls += 1
        best = max(best, 2 * 1024 ** 3 * calls / (time.perf_counter() - t0))
    return best


def cpu_model():
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_peak_table(dtype):
    """(the cache file of CPU peaks, its table, this process's key in it)."""
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                         "roformer", "cpu_peak.json")
    key = f"{cpu_model()} | {torch.get_num_threads()} threads | {dtype} | torch " \
          f"{torch.__version__}"
    table = None
    with contextlib.suppress(OSError, ValueError), open(cache) as f:
        table = json.load(f)
    return cache, table if isinstance(table, dict) else {}, key


def save_cpu_peaks(cache, table):
    with contextlib.suppress(OSError):  # a read-only home: time it again next run
        atomic_write(cache, lambda tmp: Path(tmp).write_text(json.dumps(table)))


def forget_cpu_peak(dtype):
    """Drop this CPU's cached peak: an MFU above 100% proved it too low (timed while the
    machine was busy), so the next run times it again."""
    cache, table, key = cpu_peak_table(dtype)
    if table.pop(key, None) is not None:
        save_cpu_peaks(cache, table)


def cpu_peak_flops(dtype, ddp):
    """One process's CPU peak in `dtype`: time_matmul's rate, timed once per CPU model, thread
    count, dtype and torch version and kept in ~/.cache/roformer/cpu_peak.json (delete it to
    time again; forget_cpu_peak drops one a run disproved), so a short run does not pay for
    the probe. Under DDP rank 0 times it alone and shares it: ranks timing at once on shared
    cores would each measure a fraction of it."""
    peak = torch.zeros((), dtype=torch.float64)
    if not ddp or torch.distributed.get_rank() == 0:
        cache, table, key = cpu_peak_table(dtype)
        if not isinstance(table.get(key), float):
            table[key] = time_matmul(dtype)
            save_cpu_peaks(cache, table)
        peak.fill_(table[key])
    if ddp:
        torch.distributed.broadcast(peak, src=0)
    return peak.item()


# ----------------------------------------------------------------------------------------
# signals and progress

def stop_on_signals():
    """SIGTERM/SIGINT: finish the step in flight, save, exit 0; a second Ctrl-C stops at once,
    a second SIGTERM does not (a launcher's death can deliver two, and the second would kill
    the save in flight). Returns a list that is non-empty once a signal came."""
    stop = []

    def on_signal(signum, frame):
        stop.append(signum)
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    return stop


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal; under a pipe or a file (CI, SLURM, `> log`)
    one plain line per log_interval, since a bar's carriage-return updates would write
    megabytes there. Tokens/s is smoothed over steps, the first (compilation) ones skipped.
    An MFU above 100% cannot be right: the peak is wrong (a CPU's, timed while the machine was
    busy), so it is n/a from then on and forget_peak() drops the cached peak it disproved."""

    def __init__(self, start_iter, max_iters, tokens_per_iter, flops_per_token, peak, world,
                 master, forget_peak=None):
        self.interactive = sys.stderr.isatty()
        self.bar = tqdm(total=max_iters, initial=start_iter, dynamic_ncols=True, unit="it",
                        disable=not master or not self.interactive)
        self.start_iter, self.max_iters, self.t_start = start_iter, max_iters, time.time()
        self.tokens_per_iter, self.tok_s = tokens_per_iter, None
        # MFU is per device: the FLOPs of one device's share of the tokens over its peak
        self.mfu_per_tok = flops_per_token / world / peak if peak else None
        self.forget_peak = forget_peak

    def log(self, iter_num, loss, grad_norm, dt):
        rate = self.tokens_per_iter / dt
        if iter_num - self.start_iter > 2:
            self.tok_s = rate if self.tok_s is None else 0.9 * self.tok_s + 0.1 * rate
        post = {"loss": f"{loss:.4f}", "gnorm": f"{grad_norm:.3f}"}
        if self.tok_s:
            mfu = self.mfu_per_tok and self.mfu_per_tok * self.tok_s
            if mfu and mfu > 1:
                self.mfu_per_tok = mfu = None
                self.write("note: MFU came out above 100%: the peak it is measured against is "
                           "too low (timed while the machine was busy?); MFU is n/a for this "
                           "run" + (", and the peak is timed again next run"
                                    if self.forget_peak else ""))
                if self.forget_peak:
                    self.forget_peak()
            post["tok/s"] = f"{self.tok_s:,.0f}"  # all ranks together
            post["mfu"] = f"{100 * mfu:.1f}%" if mfu else "n/a"
        if self.interactive:
            self.bar.update(iter_num - self.bar.n)
            self.bar.set_postfix(post)
            return
        eta = int((time.time() - self.t_start) / (iter_num - self.start_iter)
                  * (self.max_iters - iter_num))
        print(f"iter {iter_num}/{self.max_iters}: " + ", ".join(f"{k} {v}" for k, v in post.items())
              + f", eta {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}", flush=True)

    def write(self, line):
        self.bar.write(line)

    def close(self, iter_num):
        self.bar.update(iter_num - self.bar.n)
        self.bar.close()


def flops_per_token(cfg, n_params, seq_len):
    """Training FLOPs per token at length seq_len: 6 per parameter, plus attention."""
    if cfg.attention == "softmax":  # q.k and att.v over seq_len keys, no causal discount
        attn = 2 * 2 * seq_len * cfg.n_embd
    else:  # two causal chunk (L x L) products, plus the state's read and update
        length, d = min(cfg.linear_chunk, seq_len), cfg.n_embd // cfg.n_head
        attn = 2 * cfg.n_embd * (2 * length + 2 * d)
    return 6 * n_params + 3 * cfg.n_layer * attn
