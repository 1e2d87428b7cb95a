"""Reading a prepared dataset folder (meta.json, train.bin, val.bin): the one place that checks
a split, so every reader gets the same checks and a mistake is a UserError naming the file
(train.py's get_batch maps the files `Splits` opened at the start, once checked here).
Building one is data/'s job; a missing one is refused with the command that builds it."""
import functools
import json
import os
import shlex
import subprocess
import sys

import numpy as np

from harness.common import REPO, UserError


def load_meta(ddir):
    """meta.json of the dataset folder `ddir`, as a dict."""
    path = os.path.join(ddir, "meta.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); prepare the dataset again") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(meta, dict) or "dtype" not in meta or "vocab_size" not in meta:
        raise UserError(f"{path} lacks 'dtype' or 'vocab_size'; prepare the dataset again")
    try:
        np.dtype(meta["dtype"])
    except TypeError:
        raise UserError(f"{path}: unknown dtype {meta['dtype']!r}") from None
    check_fields(meta, path)
    return meta


# The fields readers compute with, and the least each may be (the counts and ids are optional:
# an older or hand-made meta.json may lack them, but one that has them has them as integers).
INT_FIELDS = {"vocab_size": 1, "train_tokens": 0, "val_tokens": 0,
              "eos_id": -1, "bos_id": -1, "unk_id": -1, "newline_id": -1}


def check_fields(meta, path):
    """Each field's type, so a wrong one is this line and not a failure where it is used."""
    if not isinstance(meta["dtype"], str) or np.dtype(meta["dtype"]).kind not in "ui":
        raise UserError(f"{path}: field 'dtype' must name an integer type (uint16, uint32), "
                        f"not {meta['dtype']!r}; prepare the dataset again")
    for name, least in INT_FIELDS.items():
        value = meta.get(name, least)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UserError(f"{path}: field {name!r} must be an integer >= {least}, not "
                            f"{value!r}; prepare the dataset again")


def open_split(ddir, split, meta=None):
    """The tokens of `split` ("train" or "val") as a read-only memmap, its size checked against
    meta.json's count, so a truncated or foreign .bin is refused. A fresh memmap per call:
    numpy keeps the pages of a long-lived memmap resident."""
    meta = load_meta(ddir) if meta is None else meta
    path = os.path.join(ddir, f"{split}.bin")
    dtype = np.dtype(meta["dtype"])
    try:
        size = os.path.getsize(path)
    except OSError:
        raise UserError(f"{path} does not exist") from None
    want = meta.get(f"{split}_tokens")
    if want is not None and size != want * dtype.itemsize:
        raise UserError(f"{path} has {size:,} bytes but meta.json records {want:,} tokens of "
                        f"{dtype.name} = {want * dtype.itemsize:,} bytes; the file is "
                        f"truncated or from another dataset: prepare it again")
    if size % dtype.itemsize:
        raise UserError(f"{path} has {size:,} bytes, not a whole number of {dtype.name} "
                        f"tokens; prepare it again")
    if size == 0:
        raise UserError(f"{path} is empty; prepare the dataset again")
    return np.memmap(path, dtype=dtype, mode="r")


def open_dataset(dataset, data_dir, master, ddp, named=True):
    """(folder, meta.json) of the dataset, with both splits checked against meta.json. The
    default corpus is built from this Python's standard library (no download, so the first
    command works on a fresh clone): rank 0 builds it, the others wait at the barrier. `named`:
    --dataset was given (else a --data_dir folder's corpus is unknown, not the default's)."""
    ddir = data_dir or os.path.join(REPO, "data", dataset)
    needed = ["train.bin", "val.bin", "meta.json"]
    missing = [f for f in needed if not os.path.exists(os.path.join(ddir, f))]
    if missing and dataset == "pystdlib" and not data_dir:
        script = f"data/{dataset}/prepare.py"
        if master:
            print(f"data/{dataset} not found: building it with {script} ...", flush=True)
            rc = subprocess.run([sys.executable, os.path.join(REPO, script)]).returncode
            if rc:
                raise UserError(f"python {script} failed (exit {rc})")
        if ddp:
            import torch.distributed as dist  # only under torchrun
            dist.barrier()
        missing = [f for f in needed if not os.path.exists(os.path.join(ddir, f))]
    if missing:
        name = dataset if named or not data_dir else ""  # "": the user's text (data/text)
        what = f"dataset '{name}'" if name else "the dataset"
        raise UserError(f"{what} not found ({ddir} lacks {', '.join(missing)}); build it with: "
                        f"{prepare_command(name, data_dir)}")
    meta = load_meta(ddir)
    for split in ("train", "val"):
        open_split(ddir, split, meta)
    return ddir, meta


class Splits:
    """A run's train.bin and val.bin, opened once when it starts and read through these open
    files to the end: preparing the dataset again publishes new files under the same names
    (data/write.py renames them into place), which a run that reopened the paths would train
    on (another tokenizer's ids, without a word). train.py's get_batch maps the open file
    afresh per batch, as it mapped the path (a long-lived memmap keeps its pages resident), so
    the step costs what it did.
    `check`, at each evaluation (a few fstat calls), stops a run whose open file was rewritten
    in place and says once that the folder was prepared again."""

    def __init__(self, ddir, meta):
        self.ddir, self.noted = ddir, False
        self.paths = {s: os.path.join(ddir, f"{s}.bin") for s in ("train", "val")}
        self.files = {s: open(p, "rb") for s, p in self.paths.items()}
        self.at_start = {s: stamp(os.fstat(f.fileno())) for s, f in self.files.items()}

    def __del__(self):  # a process's end closes them; a run inside a test's process, here
        for f in getattr(self, "files", {}).values():
            f.close()

    def check(self, say=None):
        for split, f in self.files.items():
            st, path = os.fstat(f.fileno()), self.paths[split]
            if stamp(st) != self.at_start[split]:
                raise UserError(f"{path} was rewritten in place while this run trained: it is no "
                                f"longer the data the run started with; stopping without saving "
                                f"(the last checkpoint is kept): restore the dataset, then "
                                f"resume with --init_from=resume")
            try:
                now = os.stat(path)
            except OSError:
                now = None
            if say and not self.noted and (now is None or (now.st_dev, now.st_ino) != (st.st_dev,
                                                                                st.st_ino)):
                self.noted = True
                say(f"note: {self.ddir} was prepared again (or moved) while this run trains; it "
                    f"goes on with the data it started with, whose files it holds open")


@functools.lru_cache(maxsize=None)
def doc_starts(path, dtype, eos_id, T):
    """Where train.py's windows of T+1 tokens may start under doc_aligned: the positions of
    the split's end-of-document tokens, found by one scan, once a split."""
    data = np.memmap(path, dtype, "r")
    starts = np.flatnonzero(data[:len(data) - T] == eos_id)
    if not len(starts):
        raise UserError(f"doc_aligned=True needs end-of-document tokens, and {path} has none "
                        f"before its last window: prepare it with a data/ script that ends its "
                        f"documents, or drop doc_aligned")
    return starts


def stamp(st):
    """What changes when a file is rewritten in place."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def check_split_sizes(ddir, meta, block_size):
    """Both splits hold at least one window of block_size + 1 tokens."""
    for split in ("train", "val"):
        tokens = len(open_split(ddir, split, meta))
        if tokens < block_size + 1:
            raise UserError(f"{ddir}/{split}.bin has {tokens} tokens, fewer than block_size+1 = "
                            f"{block_size + 1}; lower block_size or use more data")


def prepare_command(dataset, data_dir=""):
    """The command that builds the folder train.py reads: data/<dataset>, or data_dir. A
    dataset with no script of its own is the user's text, whose files only they can name."""
    base = dataset.removesuffix("_char")
    if os.path.exists(os.path.join(REPO, "data", dataset, "prepare.py")):
        cmd, writes = f"python data/{dataset}/prepare.py", dataset
    elif base != dataset and os.path.exists(os.path.join(REPO, "data", base, "prepare.py")):
        cmd, writes = f"python data/{base}/prepare.py --char", dataset  # writes data/<base>_char
    else:
        cmd, writes = "python data/text/prepare.py", "text"
    if cmd.startswith("python data/text/"):
        cmd += " --input PATH"  # required: the files to build it from
    # prepare's --out_dir NAME is data/NAME next to train.py; a path with a slash is as given
    out = data_dir if not data_dir or "/" in data_dir or os.sep in data_dir else f"./{data_dir}"
    if (out or dataset) != writes:
        cmd += f" --out_dir {shlex.quote(out or dataset)}"
    return cmd
