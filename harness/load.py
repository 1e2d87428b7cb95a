"""
Loading a run: ckpt.pt read (`read`, every reader's, with RoPE scaling flags applied by
`rescale`), the checkpoint -> model and tokenizer (`load_run`, `find_tokenizer`), the dataset
folder it read (`dataset_dir`, `tokenizer_sha256`), and the one-line summary (`describe`).
sample.py, eval.py and export.py load through here; writing ckpt.pt is harness/checkpoint.py's.
"""
import os
import sys
import zipfile

import torch

from harness import digest, run_tokenizer
from harness.common import UserError
from model import RoFormer, RoFormerConfig


def read(path, mmap=False, verify=True):
    """The dict in ckpt.pt (tensors on the CPU; mmap: paged in only where used). A file that is
    not one of ours is a UserError: torch's own message for an empty or non-zip file is a hint
    about _use_new_zipfile_serialization, which tells a user nothing. `verify`: its contents
    checked against the digest stored in it (harness/digest.py), so a damaged file is one line,
    not NaN weights; older files hold none."""
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
    damaged = verify and digest.mismatch(ckpt, path)
    if damaged:
        raise UserError(damaged)
    ckpt["model_args"] = {"rope_pairs": "half", **ckpt["model_args"]}  # runs from before the key
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


def load_run(out_dir, device, dtype, tokenizer="", rope_scaling="", rope_factor=0.0,
             length_temperature=-1.0):
    """out_dir -> (model in eval mode on `device` in `dtype`, sentencepiece processor, the
    checkpoint dict). rope_scaling / rope_factor ("" / 0: keep the checkpoint's) and
    length_temperature (-1: keep the checkpoint's) change positions past the trained context
    at inference, which needs no retraining."""
    if not out_dir:
        raise UserError("out_dir is empty: pass the run's folder, --out_dir=DIR")
    if not os.path.isdir(out_dir):
        raise UserError(f"out_dir {out_dir!r} does not exist (train first, or pass --out_dir=DIR)")
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(ckpt_path):
        raise UserError(f"no checkpoint at {ckpt_path}")
    ckpt = read(ckpt_path)
    try:
        config = RoFormerConfig(**ckpt["model_args"])
    except (TypeError, ValueError) as e:
        raise UserError(f"model config in {ckpt_path}: {e}") from None
    flags = {k: v for k, v in (("rope_scaling", rope_scaling), ("rope_factor", rope_factor))
             if v}
    if length_temperature != -1:  # -1: keep; any other value, 0 (off) included, is the flag's
        flags["length_temperature"] = float(length_temperature)
    if flags:  # the checkpoint's config is valid: a refusal is the flags'
        args = rescale(ckpt["model_args"], rope_scaling, rope_factor)
        if "length_temperature" in flags:
            args["length_temperature"] = flags["length_temperature"]
        try:
            config = RoFormerConfig(**args)
        except ValueError as e:
            flags = " ".join(f"--{k}={v}" for k, v in flags.items())
            raise UserError(f"{flags} does not fit this model: {e}") from None
    model = RoFormer(config)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # weights of another shape or another model file
        raise UserError(misfit(ckpt_path, e)) from None
    model.eval().to(device=device, dtype=getattr(torch, dtype))
    sp = run_tokenizer.load(find_tokenizer(out_dir, ckpt.get("tokenizer"), tokenizer))
    if sp.get_piece_size() > model.config.vocab_size:
        raise UserError(f"tokenizer has {sp.get_piece_size()} pieces, the model only "
                        f"{model.config.vocab_size}")
    return model, sp, ckpt


def find_tokenizer(run_dir, info, override=""):
    """The path of the tokenizer of the run in `run_dir` whose checkpoint records `info`: the
    `override` path if given, else run_dir's copy, else (older runs) recorded_places. The first
    file whose sha256 is the recorded one wins; another tokenizer would silently turn the
    model's ids into wrong text."""
    if not isinstance(info, dict) or not info.get("sha256"):
        if not override:  # trained from a dataset without tokenizer.model: nothing to check
            raise UserError("the checkpoint records no tokenizer; pass --tokenizer=PATH")
        print(f"note: the checkpoint records no tokenizer hash; trusting {override}",
              file=sys.stderr)
        return override
    recorded = info.get("path") or ""
    candidates = [override] if override else [os.path.join(run_dir, run_tokenizer.NAME)] + \
        run_tokenizer.recorded_places(info)
    mismatched = []
    for path in filter(os.path.isfile, filter(None, candidates)):
        if run_tokenizer.sha256(path) == info["sha256"]:
            return path
        mismatched.append(path)
    if mismatched and not override and recorded and not os.path.isfile(recorded):
        # The run's file is gone (moved, most likely); one found elsewhere is another
        # tokenizer, which says nothing about the run's having been retrained.
        raise UserError(f"the run's tokenizer {recorded} is missing (moved or deleted), and "
                        f"{mismatched[0]} is another tokenizer; pass the run's with "
                        f"--tokenizer=PATH")
    if mismatched:
        # Only the file in the dataset folder the run read can have been retrained since; a
        # file given, the run folder's copy or data/<dataset> is another tokenizer.
        why = (f"the dataset in {os.path.dirname(recorded)} was prepared again since the run "
               f"(its tokenizer retrained, or another corpus)" if mismatched[0] == recorded
               else "it is another tokenizer than the run's (another dataset's?)")
        raise UserError(f"tokenizer {mismatched[0]} does not match the checkpoint (sha256 "
                        f"differs from {info['sha256'][:12]}...): {why}; pass the run's own "
                        f"tokenizer.model with --tokenizer=PATH")
    raise UserError(f"tokenizer not found at {' or '.join(p for p in candidates if p)}; prepare "
                    f"the run's dataset {run_tokenizer.folder_read(info)} again or pass "
                    f"--tokenizer=PATH")


def dataset_dir(ckpt, gone_ok=False):
    """The folder of the run's dataset (val.bin, meta.json), for eval.py --split and export.py's
    check. A run records the folder it read (config data_dir, an absolute path): that folder, or
    a UserError saying it is gone (None with gone_ok); never another corpus. Older checkpoints
    hold the --data_dir given ("" or relative: no record) and keep the old search: that
    data_dir, the tokenizer's folder, data/<dataset> (None when none is there). Either way a
    folder whose tokenizer.model is not the run's is refused: its val.bin holds another
    vocabulary's ids."""
    info = ckpt.get("tokenizer") or {}
    recorded = (ckpt.get("config") or {}).get("data_dir")
    recorded = recorded if recorded and os.path.isabs(recorded) else None
    candidates = [recorded] if recorded else [info.get("data_dir")] + [
        os.path.dirname(p) for p in run_tokenizer.recorded_places(info)]
    found = [d for d in candidates
             if d and all(os.path.isfile(os.path.join(d, f)) for f in ("val.bin", "meta.json"))]
    for d in found:
        if not info.get("sha256") or tokenizer_sha256(d) == info["sha256"]:
            return d  # (a run without tokenizer.model has nothing to check)
    if found:
        what = "missing" if tokenizer_sha256(found[0]) is None else "another"
        raise UserError(f"{found[0]} is not the dataset this run read: its tokenizer.model is "
                        f"{what} (the run's has sha256 {info['sha256'][:12]}...): prepared "
                        f"again since, or another corpus")
    if recorded and not gone_ok:
        raise UserError(f"the run read its data from {recorded}, which is gone (no val.bin and "
                        f"meta.json there)")
    return None


def tokenizer_sha256(folder):
    return run_tokenizer.sha256(os.path.join(folder, run_tokenizer.NAME))


def describe(out_dir, ckpt, model):
    """One line about the loaded run, for stderr."""
    c, p = model.config, next(model.parameters())
    dtype = str(p.dtype).removeprefix("torch.")
    temperature = f", length temperature {c.length_temperature:g}" if c.length_temperature else ""
    return (f"{os.path.join(out_dir, 'ckpt.pt')}: iter {ckpt.get('iter_num')}, val loss "
            f"{ckpt.get('best_val_loss', float('nan')):.4f}, {model.num_params() / 1e6:.2f}M "
            f"params, {c.attention} attention, {c.pos_encoding} positions, rope_scaling "
            f"{c.rope_scaling} x{c.rope_factor:g}, window {c.context_window} (original context "
            f"{c.original_context}){temperature}; {p.device} {dtype}")
