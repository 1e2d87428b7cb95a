"""A checkpoint's digest: the sha256 of everything ckpt.pt holds (tensor bytes, their dtypes and
shapes, and every other value), stored in it under "digest" when it is written
(harness/checkpoint.py's commit) and checked on every read (harness/load.py's read). torch.load
checks a zip archive's headers, not its tensors' bytes: a block of a tensor changed on the disk
or in a copy loads, and the model samples "⁇". An FSDP run's DCP folder has its files' digest
in ckpt.pt too (`folder_digest`). Checkpoints from before digests hold none and load as
before."""
import hashlib
import os

import torch

KEY = "digest"


def payload_digest(obj):
    """'sha256:HEX' of `obj` (the checkpoint dict, its own digest left out). The walk is the
    same for the dict as written and as torch.load returns it: dicts in their order (pickle
    keeps it), lists and tuples alike (a checkpoint may give back either), a tensor by its
    dtype, shape and bytes, any other value by its type and repr."""
    h = hashlib.sha256()
    walk(h, {k: v for k, v in obj.items() if k != KEY})
    return "sha256:" + h.hexdigest()


def walk(h, obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().data)  # the bytes, whatever the dtype: no copy
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}:".encode())
        for k, v in obj.items():
            walk(h, k)
            walk(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}:".encode())
        for v in obj:
            walk(h, v)
    else:
        text = repr(obj).encode("utf-8", "backslashreplace")
        h.update(f"{type(obj).__name__}{len(text)}:".encode() + text)


def mismatch(ckpt, path):
    """None when `ckpt` (read from `path`) holds no digest or its own; else the one line that
    refuses it."""
    want = ckpt.get(KEY)
    if want is None or payload_digest(ckpt) == want:
        return None
    return (f"cannot load {path}: its contents changed since it was saved (their sha256 is not "
            f"the digest stored in it: damaged on the disk or in a copy); restore the file from "
            f"a good copy, or train again")


def folder_digest(folder):
    """'sha256:HEX' of an FSDP run's DCP folder: each file's name and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        h.update(name.encode() + b"\0")
        with open(os.path.join(folder, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return "sha256:" + h.hexdigest()
