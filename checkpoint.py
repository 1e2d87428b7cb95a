"""
How sample.py, eval.py and export.py start: a run's out_dir -> its ckpt.pt -> the model, on a
device and dtype, and the sentencepiece tokenizer it was trained with (checked by sha256).

Every way this can go wrong for a user (no folder, no checkpoint, a truncated or foreign
file, a tokenizer that moved or was retrained) stops with one `error: ...` line.

The checkpoint contract: out_dir/ckpt.pt holds `model` (the uncompiled module's state dict),
`model_args` (the RoFormerConfig fields), `config`, `tokenizer` (dataset, path, sha256),
`iter_num` and `best_val_loss`. Runs that train sharded still keep this consolidated file.
"""
import os
import sys

import torch

from configurator import cuda_autocast_dtype, file_sha256
from model import RoFormer, RoFormerConfig

REPO = os.path.dirname(os.path.abspath(__file__))
DTYPES = ("float32", "bfloat16", "float16")


def pick_device(device="auto", dtype="auto"):
    """Resolve 'auto' and check the names; returns (torch.device, dtype name). Called before
    anything is loaded, so a typo does not wait for a checkpoint."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        sys.exit(f"error: unknown device {device!r} (auto, cpu, cuda, cuda:N, mps)")
    if dtype == "auto":
        # bf16 only where the GPU computes in it natively (emulated bf16 is slow); float32 on
        # the CPU (bf16 decoding there measured faster only on a quiet machine, see README)
        dtype = cuda_autocast_dtype() if dev.type == "cuda" else "float32"
    if dtype not in DTYPES:
        sys.exit(f"error: dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return dev, dtype


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
    if mismatched:
        sys.exit(f"error: tokenizer {mismatched[0]} does not match the checkpoint (sha256 differs "
                 f"from {info['sha256'][:12]}...); it was retrained since, so rebuild that dataset "
                 f"or pass the original with --tokenizer=PATH")
    sys.exit(f"error: tokenizer not found at {' or '.join(p for p in candidates if p)}; prepare "
             f"dataset '{info.get('dataset')}' again or pass --tokenizer=PATH")


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
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        model_args = dict(ckpt["model_args"])
        state = ckpt["model"]
    except Exception as e:  # a truncated or foreign file: say which file, not a traceback
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        sys.exit(f"error: cannot load {ckpt_path}: {msg}")
    if rope_scaling or rope_factor:
        if model_args.get("pos_encoding") != "rope":
            sys.exit(f"error: rope_scaling applies to RoPE models; this one uses "
                     f"pos_encoding={model_args.get('pos_encoding')!r}")
        model_args["rope_scaling"] = rope_scaling or model_args["rope_scaling"]
        model_args["rope_factor"] = rope_factor or model_args["rope_factor"]
        if model_args["rope_scaling"] == "none" and model_args["rope_factor"] != 1.0:
            sys.exit("error: rope_factor needs --rope_scaling=linear or --rope_scaling=ntk")
    try:
        model = RoFormer(RoFormerConfig(**model_args))
    except (TypeError, ValueError) as e:
        sys.exit(f"error: model config in {ckpt_path}: {e}")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # weights of another shape or another model file
        lines = str(e).splitlines()  # a header line, then the first offending keys
        detail = (lines[1] if len(lines) > 1 else lines[0]).strip()[:200]
        sys.exit(f"error: the weights in {ckpt_path} do not fit its model_args: {detail}")
    model.eval().to(device=device, dtype=getattr(torch, dtype))
    sp = load_tokenizer(ckpt.get("tokenizer"), tokenizer)
    if sp.get_piece_size() > model.config.vocab_size:
        sys.exit(f"error: tokenizer has {sp.get_piece_size()} pieces, the model only "
                 f"{model.config.vocab_size}")
    return model, sp, ckpt


def dataset_dir(ckpt):
    """The folder of the run's dataset (val.bin, meta.json), or None when it is gone."""
    info = ckpt.get("tokenizer") or {}
    for d in (info.get("data_dir"), os.path.dirname(info.get("path") or ""),
              os.path.join(REPO, "data", str(info.get("dataset")))):
        if d and all(os.path.isfile(os.path.join(d, f)) for f in ("val.bin", "meta.json")):
            return d
    return None


def describe(out_dir, ckpt, model):
    """One line about the loaded run, for stderr."""
    c = model.config
    p = next(model.parameters())
    return (f"{os.path.join(out_dir, 'ckpt.pt')}: iter {ckpt.get('iter_num')}, val loss "
            f"{ckpt.get('best_val_loss', float('nan')):.4f}, {model.num_params() / 1e6:.2f}M params, "
            f"{c.attention} attention, {c.pos_encoding} positions, rope_scaling {c.rope_scaling} "
            f"x{c.rope_factor:g}; {p.device} {str(p.dtype).removeprefix('torch.')}")
