"""A run's tokenizer. train.py keeps a copy of the dataset's tokenizer.model in out_dir
(lib/run.py's keep_tokenizer), so that a run folder needs nothing outside itself (a later
prepare into the dataset folder may replace the dataset's); `find` is the one place that
locates a run's tokenizer file (sample.py, eval.py, export.py, prepare --tokenizer=RUN), always
checked by the sha256 the checkpoint records.
Imports only lib/common.py (data/ calls it too), and sentencepiece only where a file is parsed."""
import os
import sys

from lib.common import REPO, UserError, file_sha256

NAME = "tokenizer.model"  # in a dataset folder and in a run folder alike


def sha256(path):
    """The file's sha256, or None where there is no file."""
    return file_sha256(path) if os.path.isfile(path) else None


def load(path):
    """The sentencepiece processor of `path`; a file sentencepiece cannot parse (truncated, or no
    tokenizer at all) is one line, not its `RuntimeError: INTERNAL: could not parse ModelProto`."""
    try:  # imported here: a dataset without tokenizer.model never needs it
        import sentencepiece as spm
    except ImportError:
        raise UserError(f"the tokenizer {path} needs sentencepiece: pip install "
                        f"sentencepiece") from None
    try:
        return spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as e:
        raise UserError(f"cannot load the tokenizer {path}: sentencepiece cannot parse it "
                        f"({str(e).splitlines()[0]}); truncated, or not a tokenizer.model")


def recorded_places(info):
    """Where a run from before run folders has its tokenizer: the path train.py recorded (in the
    dataset folder it read), then data/<dataset>/ next to the scripts."""
    return [info.get("path") or "", os.path.join(REPO, "data", str(info.get("dataset")), NAME)]


def folder_read(info):
    """The dataset folder the run read, for a hint (never --dataset's name alone: a run trained
    with --data_dir did not read data/<dataset>)."""
    return os.path.dirname(info.get("path") or "") or f"data/{info.get('dataset')}"


def find(run_dir, info, override=""):
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
    candidates = [override] if override else [os.path.join(run_dir, NAME)] + recorded_places(info)
    mismatched = []
    for path in filter(os.path.isfile, filter(None, candidates)):
        if file_sha256(path) == info["sha256"]:
            return path
        mismatched.append(path)
    if mismatched and not override and recorded and not os.path.isfile(recorded):
        # The run's file is gone (moved, most likely); one found elsewhere is another
        # tokenizer, which says nothing about the run's having been retrained.
        raise UserError(f"the run's tokenizer {recorded} is missing (moved or deleted), and "
                        f"{mismatched[0]} is another tokenizer; pass the run's with "
                        f"--tokenizer=PATH")
    if mismatched:
        raise UserError(f"tokenizer {mismatched[0]} does not match the checkpoint (sha256 "
                        f"differs from {info['sha256'][:12]}...); it was retrained since, so "
                        f"rebuild that dataset or pass the original with --tokenizer=PATH")
    raise UserError(f"tokenizer not found at {' or '.join(p for p in candidates if p)}; prepare "
                    f"the run's dataset {folder_read(info)} again or pass --tokenizer=PATH")
