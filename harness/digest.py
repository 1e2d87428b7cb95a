"""A checkpoint's digest: the sha256 of the tensors ckpt.pt holds (their bytes, places, dtypes
and shapes), stored in it under "digest" when it is written (harness/checkpoint.py's commit)
and checked on every read (harness/load.py's read). torch.load
checks a zip archive's headers, not its tensors' bytes: a block of a tensor changed on the disk
or in a copy loads, and the model samples "⁇". An FSDP run's DCP folder has its files' digest
in ckpt.pt too (`folder_digest`). Checkpoints from before digests hold none and load as
before."""
import hashlib
import os

import torch

KEY = "digest"


def payload_digest(obj):
    """'sha256:HEX' of the payload of `obj` (the checkpoint dict): every tensor's bytes, with
    its place in the dict, dtype and shape; found by the same walk in the dict as written and
    as torch.load returns it (dicts in their order, which pickle keeps; lists and tuples
    alike). The other values (model_args, config, the tokenizer's record, counters) are
    pickled text that torch.load parses, and a tool or a person may edit them on purpose; the
    tensors are the bytes nothing else checks."""
    h = hashlib.sha256()
    for where, t in tensors({k: v for k, v in obj.items() if k != KEY}):
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{where}:{t.dtype}:{tuple(t.shape)}:{t.numel()}\0".encode())
        h.update(t.view(torch.uint8).numpy().data)  # the bytes, whatever the dtype: no copy
    return "sha256:" + h.hexdigest()


def tensors(obj, where=""):
    """(place, tensor) for every tensor inside `obj`, depth first."""
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{where}/{k!r}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{where}/{i}")


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
