"""
Every checkpoint read and write, and the device/dtype resolver of every script.

sample.py, eval.py and export.py start with load_run: a run's out_dir -> its ckpt.pt -> the
model on a device and dtype, and the sentencepiece tokenizer it was trained with (checked by
sha256). train.py saves with save and resumes with read + load_state.

The format. out_dir/ckpt.pt always exists and always holds `model` (the uncompiled module's
full state dict), `model_args` (the RoFormerConfig fields), `config`, `tokenizer` (dataset,
path, sha256), `iter_num`, `best_val_loss`, and what exact resume needs (RNG, tokens, run id).
A one-process or DDP run also keeps `optimizer` in it. An FSDP run keeps model and optimizer in
a DCP folder beside it instead (every rank writes its own shards, nobody gathers the optimizer)
and ckpt.pt names that folder (`sharded`). ckpt.pt is replaced last, atomically: it is the
commit point, so a crash, a full disk or a power loss at any moment leaves the previous ckpt.pt
and the folder it names intact.

Every way this can go wrong for a user (no folder, no checkpoint, a truncated or foreign
file, weights that do not fit, a tokenizer that moved or was retrained) is one `error: ...`
line: load_run exits with it; train.py's functions raise CheckpointError with it.
"""
import contextlib
import os
import random
import shutil
import sys
import warnings
import zipfile

import numpy as np
import torch

from configurator import cpu_has_bf16, cuda_autocast_dtype, file_sha256
from model import RoFormer, RoFormerConfig

REPO = os.path.dirname(os.path.abspath(__file__))
DTYPES = ("float32", "bfloat16", "float16")


class CheckpointError(ValueError):
    pass


def pick_device(device="auto", dtype="auto", training=False):
    """Resolve 'auto' and check the names; returns (torch.device, dtype name). Called before
    anything is loaded, so a typo does not wait for a checkpoint. Training also takes MPS, and
    bf16 autocast on a CPU that multiplies bf16 natively (faster, same loss at equal steps; see
    docs/); decoding stays float32 on the CPU."""
    if device == "auto":
        mps = training and getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()
        device = "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        sys.exit(f"error: unknown device {device!r} (auto, cpu, cuda, cuda:N, mps)")
    if dev.type not in ("cpu", "cuda", "mps"):  # meta holds no data; others are untested here
        sys.exit(f"error: device={device!r} is not supported (auto, cpu, cuda, cuda:N, mps)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"error: device={device!r} but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        sys.exit(f"error: device={device!r} but this machine has {torch.cuda.device_count()} "
                 f"CUDA device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None)
                                  and torch.backends.mps.is_available()):
        sys.exit(f"error: device={device!r} but MPS (Apple's GPU backend) is not available")
    if dtype == "auto":
        if dev.type == "cuda":
            dtype = cuda_autocast_dtype()  # bf16 where native, else fp16 (T4, V100)
        else:
            dtype = "bfloat16" if training and dev.type == "cpu" and cpu_has_bf16() else "float32"
    if dtype not in DTYPES:
        sys.exit(f"error: dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    if training and dtype == "float16" and dev.type != "cuda":
        sys.exit("error: dtype=float16 needs CUDA (its GradScaler); use bfloat16 or float32")
    if training and dtype == "bfloat16" and dev.type == "cpu" and not cpu_has_bf16():
        print("warning: this CPU has no native bf16 matmul; bfloat16 will be emulated and slow")
    return dev, dtype


# ----------------------------------------------------------------------------------------
# reading

def read(path, mmap=False):
    """The dict in ckpt.pt (tensors on the CPU; mmap: paged in only where used). A file that is
    not one of ours raises CheckpointError: torch's own message for an empty or non-zip file
    is a hint about _use_new_zipfile_serialization, which tells a user nothing."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise CheckpointError(f"cannot load {path}: {e.strerror}") from None
    if size == 0 or not zipfile.is_zipfile(path):
        why = "an empty file" if size == 0 else "not a zip archive: truncated, or another file"
        raise CheckpointError(f"cannot load {path}: it is not a checkpoint ({why})")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # a damaged archive: say which file, not a traceback
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"cannot load {path}: it is not a checkpoint ({msg})") from None
    if not isinstance(ckpt, dict) or "model_args" not in ckpt or "model" not in ckpt:
        raise CheckpointError(f"cannot load {path}: it is not a checkpoint of this project "
                              f"(no model weights and model_args)")
    return ckpt


def misfit(path, err):
    """The one line for weights that do not fit the checkpoint's model_args."""
    lines = str(err).splitlines()  # a header line, then the first offending keys
    detail = (lines[1] if len(lines) > 1 else lines[0]).strip()[:200]
    return f"the weights in {path} do not fit its model_args: {detail}"


def load_state(ckpt, path, raw_model, optimizer):
    """Load model weights and optimizer state of `ckpt` (read from `path`) into raw_model and
    optimizer, whatever wrote it and however they are sharded now: DCP reshards an FSDP run's
    folder to any number of ranks, FSDP or not. The optimizer keeps this command's
    hyperparameters."""
    if "sharded" not in ckpt and "optimizer" not in ckpt:
        raise CheckpointError(f"{path} holds no optimizer state: it cannot be resumed")
    # load_state_dict also brings back the old run's hyperparameters (weight_decay, betas,
    # eps, fused, ...); this command's settings are the ones that must run, so put them back.
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    load_weights_and_optimizer(ckpt, path, raw_model, optimizer)
    for group, kept in zip(optimizer.param_groups, settings):
        group.update(kept)


def load_weights_and_optimizer(ckpt, path, raw_model, optimizer):
    """ckpt.pt's full state, cut into shards if the model is sharded; or the DCP folder it
    names, resharded to this run's ranks."""
    import parallel  # here: sample.py and friends need none of torch.distributed
    folder = os.path.join(os.path.dirname(path), ckpt.get("sharded") or "")
    if "sharded" in ckpt and not os.path.isdir(folder):
        raise CheckpointError(f"{path} names {folder}, which does not exist")
    try:
        if "sharded" not in ckpt:
            parallel.load_full_state(raw_model, optimizer, ckpt["model"], ckpt["optimizer"])
            return
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        state = parallel.sharded_state(raw_model, optimizer)
        with warnings.catch_warnings():  # it warns about no_dist=True even when asked for it
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
        parallel.set_sharded_state(raw_model, optimizer, state)
    except (RuntimeError, ValueError) as e:  # weights or optimizer state of another shape
        raise CheckpointError(misfit(path, e)) from None


def load_tokenizer(info, override):
    """The checkpoint's sentencepiece model: the explicit `override` path, else the recorded
    absolute path, else data/<dataset>/tokenizer.model next to this file. The first file
    whose sha256 matches the checkpoint wins; a different tokenizer would silently turn the
    model's ids into the wrong text."""
    try:  # imported here: only checkpoints with a tokenizer need it
        import sentencepiece as spm
    except ImportError:
        sys.exit("error: this checkpoint's tokenizer needs sentencepiece: pip install sentencepiece")
    if not isinstance(info, dict) or not info.get("sha256"):
        if not override:  # trained from a dataset without tokenizer.model: nothing to check
            sys.exit("error: the checkpoint records no tokenizer; pass --tokenizer=PATH")
        print(f"note: the checkpoint records no tokenizer hash; trusting {override}",
              file=sys.stderr)
        return spm.SentencePieceProcessor(model_file=override)
    candidates = [override] if override else [
        info.get("path", ""), os.path.join(REPO, "data", str(info.get("dataset")), "tokenizer.model")]
    mismatched = []
    for path in candidates:
        if path and os.path.isfile(path):
            if file_sha256(path) == info["sha256"]:
                return spm.SentencePieceProcessor(model_file=path)
            mismatched.append(path)
    recorded = info.get("path", "")
    if mismatched and not override and recorded and not os.path.isfile(recorded):
        # The run's file is gone (moved, most likely); the one found under data/<dataset>/ is
        # another tokenizer, which says nothing about the run's having been retrained.
        sys.exit(f"error: the run's tokenizer {recorded} is missing (moved or deleted), and "
                 f"{mismatched[0]} is another tokenizer; pass the run's with --tokenizer=PATH")
    if mismatched:
        sys.exit(f"error: tokenizer {mismatched[0]} does not match the checkpoint (sha256 differs "
                 f"from {info['sha256'][:12]}...); it was retrained since, so rebuild that dataset "
                 f"or pass the original with --tokenizer=PATH")
    sys.exit(f"error: tokenizer not found at {' or '.join(p for p in candidates if p)}; prepare "
             f"dataset '{info.get('dataset')}' again or pass --tokenizer=PATH")


def rescale(model_args, rope_scaling, rope_factor):
    """model_args with the inference-time RoPE scaling applied ("" / 0: keep the checkpoint's).
    "none" means factor 1: it switches a checkpoint's scaling off."""
    scaling = rope_scaling or model_args.get("rope_scaling", "none")
    if scaling == "none":
        if rope_factor not in (0, 1):
            raise CheckpointError("rope_factor needs --rope_scaling=linear or --rope_scaling=ntk")
        factor = 1.0
    else:
        factor = rope_factor or model_args.get("rope_factor", 1.0)
        if model_args.get("pos_encoding") != "rope":
            raise CheckpointError(f"rope_scaling applies to RoPE models; this one uses "
                                  f"pos_encoding={model_args.get('pos_encoding')!r}")
    return dict(model_args, rope_scaling=scaling, rope_factor=float(factor))


def load_run(out_dir, device, dtype, tokenizer="", rope_scaling="", rope_factor=0.0):
    """out_dir -> (model in eval mode on `device` in `dtype`, sentencepiece processor, the
    checkpoint dict). rope_scaling / rope_factor ("" / 0: keep the checkpoint's) change the
    rotation at inference, which needs no retraining."""
    if not os.path.isdir(out_dir):
        sys.exit(f"error: out_dir {out_dir!r} does not exist (train first, or pass --out_dir=DIR)")
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(ckpt_path):
        sys.exit(f"error: no checkpoint at {ckpt_path}")
    try:
        ckpt = read(ckpt_path)
        model_args = dict(ckpt["model_args"])
        config = RoFormerConfig(**model_args)
    except CheckpointError as e:
        sys.exit(f"error: {e}")
    except (TypeError, ValueError) as e:
        sys.exit(f"error: model config in {ckpt_path}: {e}")
    if rope_scaling or rope_factor:  # the checkpoint's config is valid: a refusal is the flags'
        flags = " ".join(f"--{k}={v}" for k, v in (("rope_scaling", rope_scaling),
                                                   ("rope_factor", rope_factor)) if v)
        try:
            config = RoFormerConfig(**rescale(model_args, rope_scaling, rope_factor))
        except CheckpointError as e:
            sys.exit(f"error: {e}")
        except ValueError as e:
            sys.exit(f"error: {flags} does not fit this model: {e}")
    model = RoFormer(config)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # weights of another shape or another model file
        sys.exit(f"error: {misfit(ckpt_path, e)}")
    model.eval().to(device=device, dtype=getattr(torch, dtype))
    sp = load_tokenizer(ckpt.get("tokenizer"), tokenizer)
    if sp.get_piece_size() > model.config.vocab_size:
        sys.exit(f"error: tokenizer has {sp.get_piece_size()} pieces, the model only "
                 f"{model.config.vocab_size}")
    return model, sp, ckpt


def dataset_dir(ckpt):
    """The folder of the run's dataset (val.bin, meta.json), for eval.py --split and export.py's
    check. A run records the folder it read (config data_dir, an absolute path): that folder, or
    a CheckpointError saying it is gone; never another corpus. Older checkpoints hold the
    --data_dir given ("" or relative: no record; an absolute one is the folder they read) and
    keep the old search: that data_dir, the tokenizer's folder, data/<dataset> (None when none
    is there). Either way a folder whose tokenizer.model is not the run's is
    refused: its val.bin holds another vocabulary's ids."""
    info = ckpt.get("tokenizer") or {}
    recorded = (ckpt.get("config") or {}).get("data_dir")
    recorded = recorded if recorded and os.path.isabs(recorded) else None
    candidates = [recorded] if recorded else [
        info.get("data_dir"), os.path.dirname(info.get("path") or ""),
        os.path.join(REPO, "data", str(info.get("dataset")))]
    found = [d for d in candidates
             if d and all(os.path.isfile(os.path.join(d, f)) for f in ("val.bin", "meta.json"))]
    for d in found:
        if not info.get("sha256") or tokenizer_sha256(d) == info["sha256"]:
            return d  # (a run without tokenizer.model has nothing to check)
    if found:
        what = "missing" if tokenizer_sha256(found[0]) is None else "another"
        raise CheckpointError(f"{found[0]} is not the dataset this run read: its tokenizer.model "
                              f"is {what} (the run's has sha256 {info['sha256'][:12]}...): "
                              f"prepared again since, or another corpus")
    if recorded:
        raise CheckpointError(f"the run read its data from {recorded}, which is gone (no val.bin "
                              f"and meta.json there)")
    return None


def tokenizer_sha256(folder):
    path = os.path.join(folder, "tokenizer.model")
    return file_sha256(path) if os.path.isfile(path) else None


def describe(out_dir, ckpt, model):
    """One line about the loaded run, for stderr."""
    c = model.config
    p = next(model.parameters())
    return (f"{os.path.join(out_dir, 'ckpt.pt')}: iter {ckpt.get('iter_num')}, val loss "
            f"{ckpt.get('best_val_loss', float('nan')):.4f}, {model.num_params() / 1e6:.2f}M params, "
            f"{c.attention} attention, {c.pos_encoding} positions, rope_scaling {c.rope_scaling} "
            f"x{c.rope_factor:g}; {p.device} {str(p.dtype).removeprefix('torch.')}")


def rng_state():
    """The process's global RNG states (torch, numpy, python) in a form weights_only loads."""
    npst = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
            "python": list(random.getstate())}


def set_rng_state(saved):
    torch.set_rng_state(saved["torch"])
    np.random.set_state(tuple(saved["numpy"]))
    random.setstate((saved["python"][0], tuple(saved["python"][1]), saved["python"][2]))


# ----------------------------------------------------------------------------------------
# writing: temp file or folder, fsync, rename, fsync the folder (the rename survives a
# power loss only once the folder's entry is on disk too)

def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(path, ckpt):
    """Write ckpt.pt atomically, then delete the DCP folder that the replaced ckpt.pt named (if
    it names another one) and what crashed saves left. On a write error (a full disk) the temp
    file goes and the previous ckpt.pt stays."""
    out_dir = os.path.dirname(path) or "."
    old = None
    with contextlib.suppress(CheckpointError):  # an unreadable old file names nothing to trust
        old = read(path, mmap=True).get("sharded") if os.path.exists(path) else None
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(out_dir)
    except (OSError, RuntimeError) as e:  # torch's writer may hide the OSError behind its own
        cause = e.__context__ if isinstance(e.__context__, OSError) else e
        why = getattr(cause, "strerror", None) or str(cause).splitlines()[0]
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise CheckpointError(f"cannot write {path}: {why}; the previous checkpoint, if any, "
                              f"is kept") from None
    stale = [old] if old and old != ckpt.get("sharded") else []
    stale += [f for f in os.listdir(out_dir) if f.endswith(".dcp.tmp")]  # crashed saves
    for f in stale:
        shutil.rmtree(os.path.join(out_dir, f), ignore_errors=True)


def save_sharded(path, ckpt, raw_model, optimizer):
    """An FSDP run's save, a collective: every rank writes its shards of model and optimizer to
    a fresh DCP folder, rank 0 adds the consolidated weights to ckpt.pt, which names the
    folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import parallel
    out_dir, rank0 = os.path.dirname(path) or ".", dist.get_rank() == 0
    # A fresh folder name, even when re-saving the same iteration: the folder that the
    # current ckpt.pt names must survive until the new ckpt.pt replaces it.
    name = [None]
    if rank0:
        k = 0
        while any(os.path.exists(os.path.join(out_dir, f"ckpt-{ckpt['iter_num']}.{k}.dcp{s}"))
                  for s in ("", ".tmp")):
            k += 1
        name = [f"ckpt-{ckpt['iter_num']}.{k}.dcp"]
    dist.broadcast_object_list(name, src=0)
    folder = os.path.join(out_dir, name[0])
    try:  # sync_files: each rank fsyncs its shard files before the folder is renamed
        dcp.save(parallel.sharded_state(raw_model, optimizer),
                 storage_writer=dcp.FileSystemWriter(folder + ".tmp", sync_files=True))
    except Exception as e:  # a full disk on any rank fails the save on every rank
        if rank0:
            shutil.rmtree(folder + ".tmp", ignore_errors=True)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"cannot write {folder}: {msg}; the previous checkpoint, if any, "
                              f"is kept") from None
    ckpt = dict(ckpt, model=parallel.full_weights(raw_model), sharded=name[0])
    error = None
    if rank0:
        try:  # dcp.save returns on rank 0 after every rank has written its files
            os.replace(folder + ".tmp", folder)
            fsync_dir(out_dir)
            commit(path, ckpt)
        except (OSError, CheckpointError) as e:
            error = str(e)
    errors = [error]
    dist.broadcast_object_list(errors, src=0)  # everyone returns with the checkpoint committed
    if errors[0]:
        raise CheckpointError(errors[0])


def save(path, meta, raw_model, optimizer):
    """Write the checkpoint `path` (out_dir/ckpt.pt): `meta` (iteration, RNG, config, ...)
    plus the full model weights, and the optimizer (in the file, or in a DCP folder for an
    FSDP model). Every rank must call this: with FSDP it is a collective. Raises
    CheckpointError with one line when it cannot write (the previous checkpoint stays)."""
    import parallel
    if parallel.is_sharded(raw_model):
        return save_sharded(path, meta, raw_model, optimizer)
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        # the uncompiled module's state: no _orig_mod. prefixes
        commit(path, dict(meta, model=raw_model.state_dict(), optimizer=optimizer.state_dict()))
