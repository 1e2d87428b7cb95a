"""A run's tokenizer: its file's name, its sha256, parsing it, where older runs kept it, and its
identity (what the checkpoint records of it, tokenizer_identity). train.py keeps a copy of the
dataset's tokenizer.model in out_dir (harness/out_dir.py's keep_tokenizer), so that a run
folder needs nothing outside itself (a later prepare into the dataset folder may replace the
dataset's); harness/load.py's find_tokenizer is the one place that locates a run's tokenizer
(sample.py, eval.py, export.py, prepare --tokenizer=RUN), always checked by the sha256 the
checkpoint records. Imports only harness/common.py (data/ calls it too), and sentencepiece
only where a file is parsed."""
import hashlib
import os

from harness.common import REPO, UserError

NAME = "tokenizer.model"  # in a dataset folder and in a run folder alike


def file_sha256(path):
    """A tokenizer's identity: train.py records it, sample.py checks it, so a retrained
    tokenizer never silently turns ids into the wrong text."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


def tokenizer_identity(dataset, data_dir, ddir, meta):
    """What the checkpoint records about the tokenizer: sample.py finds the file by it and
    checks it by its sha256 (None for a dataset without tokenizer.model)."""
    path = os.path.abspath(os.path.join(ddir, NAME))
    if os.path.exists(path):  # one line now, not a sentencepiece error at the first sample
        pieces = load(path).get_piece_size()
        if meta["vocab_size"] < pieces:  # prepare writes the piece count; more only pads
            raise UserError(f"{os.path.join(ddir, 'meta.json')} says vocab_size="
                            f"{meta['vocab_size']}, but its tokenizer {path} has {pieces} "
                            f"pieces: meta.json was edited or is another prepare's; prepare "
                            f"the dataset again (or set its vocab_size back to {pieces})")
    return {"dataset": dataset, "data_dir": data_dir, "path": path,
            "sha256": file_sha256(path) if os.path.exists(path) else None,
            "vocab_size": meta["vocab_size"], "eos_id": meta.get("eos_id"),
            "bos_id": meta.get("bos_id")}
