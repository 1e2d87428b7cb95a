"""out_dir, the run folder: made and proved writable, locked by rank 0 for the whole run, refused
where it is a dataset folder, another run's checkpoint moved aside, the run's copy of its
tokenizer kept there; and the run's id."""
import os
import shutil
import time
import uuid

import torch

from harness import run_tokenizer
from harness.common import UserError, created_files
from harness.files import atomic_write, make_out_dir


def barrier(ddp):
    if ddp:
        torch.distributed.barrier()


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
