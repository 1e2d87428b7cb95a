"""Stage 6: writing. Every output goes to a hidden temp name and is published (harness/files.py:
fsync, rename, fsync the folder) at the end, meta.json last, so a folder with meta.json is
complete; a failure removes the temp files and leaves the dataset already there as it was."""
import json
import os

from data.shared import OUTPUTS
from harness import files
from harness.common import UserError

# Fields every meta.json prepare ever wrote holds: a folder whose meta.json has them is its own.
OWN_META_KEYS = ("source_sha256", "source_hash_of", "tokenizer")


def check_own_folder(out_dir):
    """Refuse, before any work, an out_dir whose meta.json prepare did not write (another
    tool's dataset, a hand-made folder), or one that holds a training run: prepare would
    replace it."""
    if os.path.lexists(os.path.join(out_dir, "ckpt.pt")):  # train.py refuses it since; older runs
        raise UserError(f"{out_dir} holds a training run (ckpt.pt): preparing into it would "
                        f"replace the run's tokenizer.model; pass another --out_dir")
    path = os.path.join(out_dir, "meta.json")
    if not os.path.lexists(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):  # unreadable, or not JSON: not one prepare wrote
        meta = None
    if not isinstance(meta, dict) or not all(k in meta for k in OWN_META_KEYS):
        raise UserError(f"{path} was not written by prepare; it would be replaced, so pass "
                        f"another --out_dir (a new or empty folder, or one prepare made)")


def make_out_dir(out_dir):
    """Create out_dir if needed, prove it writable, and remove the temp files of an earlier run
    that was killed outright (SIGKILL). Returns True when this call created the folder."""
    created = files.make_out_dir(out_dir, "output folder")
    for fn in os.listdir(out_dir):
        if any(fn.startswith(f".{out}.tmp.") for out in OUTPUTS):
            os.remove(os.path.join(out_dir, fn))
    return created


def tmp_names(out_dir):
    # Hidden and suffixed: nothing reading the folder mistakes them for finished outputs.
    return {fn: os.path.join(out_dir, f".{fn}.tmp.{os.getpid()}") for fn in OUTPUTS}


def write_tokenizer(tmps, model_bytes, sp):
    """tokenizer.model, and tokenizer.vocab: each piece (repr) and its score, for reading."""
    with open(tmps["tokenizer.model"], "wb") as f:
        f.write(model_bytes)
    with open(tmps["tokenizer.vocab"], "w", encoding="utf-8") as f:
        for i in range(sp.get_piece_size()):
            f.write(f"{sp.id_to_piece(i)!r}\t{sp.get_score(i)}\n")


def write_meta(tmps, meta):
    with open(tmps["meta.json"], "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")


def commit(tmps, out_dir):
    """Rename the finished temp files to their names. The old meta.json goes first, so that a
    crash between the renames never leaves a meta.json beside files from another run."""
    final = {fn: os.path.join(out_dir, fn) for fn in OUTPUTS}
    if os.path.exists(final["meta.json"]):
        os.remove(final["meta.json"])
    for fn in OUTPUTS:
        files.publish(tmps[fn], final[fn])


def remove_partial(tmps, out_dir, created):
    """After a failure: the temp files go, and the folder too if this run created it."""
    for path in tmps.values():
        if os.path.exists(path):
            os.remove(path)
    if created and not os.listdir(out_dir):
        os.rmdir(out_dir)
