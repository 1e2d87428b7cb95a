"""
Writing ckpt.pt: train.py with `save` (harness/parallel.py an FSDP run's, through `commit`),
atomically, with the RNG states a resume puts back. Reading it is harness/load.py's `read`.
What ckpt.pt holds, and why it is the commit point: docs/TRAINING.md.
"""
import contextlib
import os
import random

import numpy as np
import torch

from harness import digest
from harness.common import UserError
from harness.files import atomic_write, remove
from harness.load import read


def rng_state():
    """The process's global RNG states (torch, numpy, python) in a form weights_only loads."""
    npst = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
            "python": list(random.getstate())}


def set_rng_state(saved):  # rng_state's inverse (harness/resume.py)
    torch.set_rng_state(saved["torch"])
    np.random.set_state(tuple(saved["numpy"]))
    random.setstate((saved["python"][0], tuple(saved["python"][1]), saved["python"][2]))


def commit(path, ckpt):
    """Write ckpt.pt atomically (through .ckpt.pt.PID.tmp: a name of this process's own), then
    delete the DCP folder that the replaced ckpt.pt named (if it names another one) and what
    crashed saves left: train.py holds out_dir's lock, so no temp there is a live run's. On a
    write error (a full disk) the temp file goes and the previous ckpt.pt stays. The file holds
    the digest of its contents, which every read checks (harness/digest.py)."""
    out_dir = os.path.dirname(path) or "."
    old = None
    with contextlib.suppress(UserError):  # an unreadable old file names nothing to trust
        old = read(path, mmap=True, verify=False).get("sharded") if os.path.exists(path) \
            else None
    ckpt = dict(ckpt, **{digest.KEY: digest.payload_digest(ckpt)})  # checked on every read
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
    harness/parallel.save_sharded instead, a collective). A UserError (one line) when it cannot
    write; the previous checkpoint stays."""
    if rank == 0:  # the uncompiled module's state: no _orig_mod. prefixes
        commit(path, dict(meta, model=raw_model.state_dict(), optimizer=optimizer.state_dict()))
