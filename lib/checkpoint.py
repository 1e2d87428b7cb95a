"""
ckpt.pt: train.py saves here, lib/resume.py and lib/load.py's
load_run read with `read` (and apply RoPE scaling flags to its model_args with `rescale`). What
ckpt.pt holds, and why it is the commit point: docs/TRAINING.md.
"""
import contextlib
import os
import random
import zipfile

import numpy as np
import torch

from lib.common import UserError, atomic_write, remove


# ----------------------------------------------------------------------------------------
# reading

def read(path, mmap=False):
    """The dict in ckpt.pt (tensors on the CPU; mmap: paged in only where used). A file that is
    not one of ours is a UserError: torch's own message for an empty or non-zip file is a hint
    about _use_new_zipfile_serialization, which tells a user nothing."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise UserError(f"cannot load {path}: {e.strerror}") from None
    if size == 0 or not zipfile.is_zipfile(path):
        why = "an empty file" if size == 0 else "not a zip archive: truncated, or another file"
        raise UserError(f"cannot load {path}: it is not a checkpoint ({why})")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # a damaged archive: say which file, not a traceback
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot load {path}: it is not a checkpoint ({msg})") from None
    if not isinstance(ckpt, dict) or "model_args" not in ckpt or "model" not in ckpt:
        raise UserError(f"cannot load {path}: it is not a checkpoint of this project (no model "
                        f"weights and model_args)")
    return ckpt


def rescale(model_args, rope_scaling, rope_factor):
    """model_args with RoPE scaling flags applied ("" / 0: keep the checkpoint's): sample.py's
    and eval.py's at inference, train.py's init_from=RUN's. "none" means factor 1: it switches
    a checkpoint's scaling off. rope_original stays (absent in older runs: block_size), so a
    fine-tuned run's window is its pretraining context * factor."""
    scaling = rope_scaling or model_args.get("rope_scaling", "none")
    if scaling == "none":
        if rope_factor not in (0, 1):
            raise UserError("rope_factor needs --rope_scaling=linear, ntk or yarn")
        factor = 1.0
    else:
        factor = rope_factor or model_args.get("rope_factor", 1.0)
        if model_args.get("pos_encoding") != "rope":
            raise UserError(f"rope_scaling applies to RoPE models; this one uses "
                            f"pos_encoding={model_args.get('pos_encoding')!r}")
    return dict(model_args, rope_scaling=scaling, rope_factor=float(factor))


def misfit(path, err):
    """The one line for weights that do not fit the checkpoint's model_args."""
    lines = str(err).splitlines()  # a header line, then the first offending keys
    detail = (lines[1] if len(lines) > 1 else lines[0]).strip()[:200]
    return f"the weights in {path} do not fit its model_args: {detail}"


def rng_state():
    """The process's global RNG states (torch, numpy, python) in a form weights_only loads."""
    npst = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
            "python": list(random.getstate())}


def set_rng_state(saved):  # rng_state's inverse (lib/resume.py)
    torch.set_rng_state(saved["torch"])
    np.random.set_state(tuple(saved["numpy"]))
    random.setstate((saved["python"][0], tuple(saved["python"][1]), saved["python"][2]))


# ----------------------------------------------------------------------------------------
# writing

def commit(path, ckpt):
    """Write ckpt.pt atomically (through .ckpt.pt.PID.tmp: a name of this process's own), then
    delete the DCP folder that the replaced ckpt.pt named (if it names another one) and what
    crashed saves left: train.py holds out_dir's lock, so no temp there is a live run's. On a
    write error (a full disk) the temp file goes and the previous ckpt.pt stays."""
    out_dir = os.path.dirname(path) or "."
    old = None
    with contextlib.suppress(UserError):  # an unreadable old file names nothing to trust
        old = read(path, mmap=True).get("sharded") if os.path.exists(path) else None
    def write(tmp):
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
    try:
        atomic_write(path, write)
    except (OSError, RuntimeError) as e:  # torch's writer may hide the OSError behind its own
        cause = e.__context__ if isinstance(e.__context__, OSError) else e
        why = getattr(cause, "strerror", None) or str(cause).splitlines()[0]
        raise UserError(f"cannot write {path}: {why}; the previous checkpoint, if any, is "
                        f"kept") from None
    stale = [old] if old and old != ckpt.get("sharded") else []
    crashed = lambda f: f.endswith(".dcp.tmp") or f == "ckpt.pt.tmp" or (  # noqa: E731
        f.startswith(".ckpt.pt.") and f.endswith(".tmp"))  # ckpt.pt.tmp: older code's name
    stale += [f for f in os.listdir(out_dir) if crashed(f)]
    for f in stale:
        remove(os.path.join(out_dir, f))


def save(path, meta, raw_model, optimizer, rank=0):
    """Write the checkpoint `path` (out_dir/ckpt.pt): `meta` (iteration, RNG, config, ...) plus
    the full model weights and the optimizer; rank 0 writes (an FSDP model saves with
    lib/parallel.save_sharded instead, a collective). A UserError (one line) when it cannot
    write; the previous checkpoint stays."""
    if rank == 0:  # the uncompiled module's state: no _orig_mod. prefixes
        commit(path, dict(meta, model=raw_model.state_dict(), optimizer=optimizer.state_dict()))
