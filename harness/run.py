"""train.py's run folder and preconditions: out_dir and its lock, run ids, the old run moved
aside, log.jsonl, the tokenizer's identity, and what is refused before anything is allocated
(a model that cannot fit, torch.compile without a C++ compiler), and the signals that stop
a run cleanly. MFU's peaks are in harness/mfu.py, the progress line in harness/progress_loop.py."""
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import sys
import time
import uuid

import torch

from harness import run_tokenizer
from harness.common import UserError, created_files
from harness.device import device_memory
from harness.files import atomic_write, make_out_dir


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
        pieces = run_tokenizer.load(path).get_piece_size()
        if meta["vocab_size"] < pieces:  # prepare writes the piece count; more only pads
            raise UserError(f"{os.path.join(ddir, 'meta.json')} says vocab_size="
                            f"{meta['vocab_size']}, but its tokenizer {path} has {pieces} "
                            f"pieces: meta.json was edited or is another prepare's; prepare "
                            f"the dataset again (or set its vocab_size back to {pieces})")
    return {"dataset": dataset, "data_dir": data_dir, "path": path,
            "sha256": run_tokenizer.file_sha256(path) if os.path.exists(path) else None,
            "vocab_size": meta["vocab_size"], "eos_id": meta.get("eos_id"),
            "bos_id": meta.get("bos_id")}


def keep_tokenizer(out_dir, identity):
    """Copy the dataset's tokenizer (train.py's record `identity`) into out_dir, atomically,
    unless the run's copy is already there; a dataset without one has nothing to copy."""
    path, want = os.path.join(out_dir, run_tokenizer.NAME), identity.get("sha256")
    if not want or run_tokenizer.sha256(path) == want:
        return
    try:
        changed = atomic_write(path, lambda tmp: shutil.copyfile(identity["path"], tmp),
                               check=lambda tmp: None if run_tokenizer.sha256(tmp) == want else
                               f"{identity['path']} changed since the run started")
    except OSError as e:
        raise UserError(f"cannot copy the tokenizer into {path}: {e.strerror or e}") from None
    if changed:
        raise UserError(f"cannot copy the tokenizer into {path}: {changed}")


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


def check_apart_from_data(out_dir, ddir):
    """Refuse an out_dir that is a dataset folder (the run's, or any with a meta.json):
    preparing that dataset again would replace the files the run keeps there (its
    tokenizer.model copy, which sample, eval and export read)."""
    real = os.path.realpath(out_dir)
    if real == os.path.realpath(ddir):
        raise UserError(f"out_dir {out_dir} is the dataset folder the run reads: preparing it "
                        f"again would replace the run's files there; pass another --out_dir")
    if os.path.isfile(os.path.join(real, "meta.json")):
        raise UserError(f"out_dir {out_dir} holds a prepared dataset (meta.json): preparing it "
                        f"again would replace the run's files there; pass another --out_dir")


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
    """Bytes one training process needs at the least, roughly, in parts [(what, the keys that
    lower it, bytes)]: 16 per parameter (float32 weights and gradients, AdamW's two moments;
    FSDP shards them over `shards` ranks), one micro-batch's float32 activations (about 16
    numbers per token and channel in each layer kept for backward, 2 with activation
    checkpointing) and its logits with their gradient. The embedding and the logits are
    parts of their own: either can dwarf the rest, and only the embedding is the vocabulary's
    alone (the logits grow with batch_size x block_size as much: --block_size=100000000 at
    vocab 512 was told to lower vocab_size)."""
    d, layers, vocab = mconf.n_embd, mconf.n_layer, mconf.vocab_size
    tokens = batch_size * mconf.block_size
    per_token = (f"batch_size ({batch_size:,}; gradient_accumulation_steps keeps the tokens per "
                 f"step), block_size ({mconf.block_size:,})")
    return [("the embedding's weights and optimizer state", "vocab_size", 16 * vocab * d // shards),
            ("the layers' weights and optimizer state", "n_layer or n_embd",  # attention
             16 * 12 * layers * d * d // shards),                            # 4 d^2, MLP 8 d^2
            ("the logits and their gradient", f"{per_token} or vocab_size", 4 * tokens * 2 * vocab),
            ("the activations", f"{per_token}, n_layer or n_embd",
             4 * tokens * layers * d * (2 if checkpointing else 16))]


def check_fits(parts, dev):
    """Refuse, before anything is allocated, a run that needs more than all of the device's
    memory (the CPU's RAM shared by this machine's ranks; a GPU's total): it would only end
    in the allocator, or swap for minutes first. Only the clearly impossible is refused, with
    the largest of training_memory's `parts` and what lowers it."""
    total = device_memory(dev) if dev.type in ("cuda", "cpu") else None
    if total is None:
        return
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if dev.type == "cpu" else 1
    total //= procs
    where = f"on {dev}" if dev.type == "cuda" else "of RAM" + (
        f" per process ({procs} share this machine)" if procs > 1 else "")
    need = sum(n for _, _, n in parts)
    if need > total:
        gib = lambda n: f"{n / 2 ** 30:,.1f} GiB"  # noqa: E731
        what, keys, most = max(parts, key=lambda part: part[2])
        raise UserError(f"this model and batch need about {gib(need)} per process, more than "
                        f"the {gib(total)} {where}; {what} take {gib(most)} of it: lower {keys}")


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


def resume_command(argv, ddp):
    """The command that continues this run after a stop: this one with --init_from=resume in
    place of any init_from it gave (under torchrun, which launches it from outside, said)."""
    if ddp:
        return "this torchrun command and --init_from=resume"
    args = [a for a in argv[1:] if not a.startswith("--init_from=")]
    return "python " + shlex.join([argv[0], *args, "--init_from=resume"])


def diverged(what, iter_num, ckpt_path):
    """The line that stops a run whose loss (`what`: the step's, or an evaluation's) at
    iter_num is not finite: nothing is saved, so the checkpoint named (if any) holds the last
    weights whose evaluation was finite."""
    if os.path.exists(ckpt_path):
        kept = (f"the last good checkpoint is {ckpt_path}: resume from it with a lower "
                f"--learning_rate (or --grad_clip=1) and --init_from=resume")
    else:
        kept = ("no checkpoint was saved: start again with a lower --learning_rate (or "
                "--grad_clip=1)")
    return f"non-finite loss at iteration {iter_num} ({what}); stopping without saving ({kept})"


def stop_if_diverged(losses, iter_num, ckpt_path, progress):
    """An evaluation whose loss ({split: loss}) is not finite stops the run before it is logged
    or saved: saved, its checkpoint would be the one the next error calls the last good one."""
    if all(map(math.isfinite, losses.values())):
        return
    progress.close(iter_num)
    raise UserError(diverged(f"evaluation: train {losses['train']:.4g}, val "
                             f"{losses['val']:.4g}", iter_num, ckpt_path))


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
