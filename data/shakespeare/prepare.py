"""Tiny Shakespeare (about 1 MB, 40k lines), downloaded when the machine is online, or taken
from a local copy with --input. --char builds a character-level variant in
data/shakespeare_char/ so results can be set beside nanoGPT's shakespeare_char.

    python data/shakespeare/prepare.py [--input FILE] [--char]

Each speech (split at blank lines) is a document, where nanoGPT cuts the text at 90% of its
length: losses are close to comparable, not identical (ours also predict each speech's end).
"""
import argparse
import os
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data import pipeline  # noqa: E402
from harness.common import REPO, UserError  # noqa: E402
from harness.files import atomic_write  # noqa: E402
from data.sources import file_sources, find_files  # noqa: E402

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def download(path, timeout):
    """Fetch tiny Shakespeare to path (atomically); offline, fail fast with a hint."""
    print(f"downloading {URL} ...")
    try:
        with urllib.request.urlopen(URL, timeout=timeout) as r:
            text = r.read()
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(text))
    except (OSError, ValueError) as e:  # URLError, timeouts and HTTP errors are OSErrors
        reason = getattr(e, "reason", e)
        raise UserError(f"could not download tiny Shakespeare ({reason}); "
                        f"pass --input PATH with a local copy of it")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", default=None, metavar="FILE",
                   help="a local copy; default: data/shakespeare/input.txt, downloaded if missing")
    p.add_argument("--char", action="store_true", help="character-level tokenizer")
    p.add_argument("--out_dir", default=None,
                   help=f"default: data/shakespeare, or data/shakespeare_char with --char; "
                        f"{pipeline.OUT_DIR_HELP}")
    pipeline.add_arguments(p, vocab_size=2048, val_fraction=0.1)
    p.add_argument("--timeout", type=float, default=10.0, help="download timeout, seconds")
    args = p.parse_args(argv)

    def body(_):
        name = "shakespeare_char" if args.char else "shakespeare"
        out_dir = pipeline.resolve_out_dir(name if args.out_dir is None else args.out_dir)
        path = args.input
        if path is None:
            path = os.path.join(REPO, "data", "shakespeare", "input.txt")
            if not os.path.exists(path):
                download(path, args.timeout)
        options = pipeline.prepare_options(args)
        if args.char:
            options.update(vocab_size=0, model_type="char")  # every character seen + bytes
        return pipeline.prepare(out_dir, name, file_sources(find_files([path])),
                                os.path.abspath(path), **options)
    return pipeline.run(body, argv)


if __name__ == "__main__":
    main()
