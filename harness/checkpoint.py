"""
Reading ckpt.pt: harness/resume.py and harness/load.py's load_run read with `read` (and apply RoPE
scaling flags to its model_args with `rescale`); train.py writes it with harness/saving.py. What
ckpt.pt holds, and why it is the commit point: docs/TRAINING.md.
"""
import os
import zipfile

import torch

from harness.common import UserError


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
