"""The default corpus: this Python's own standard library (.py sources) and the documentation
text CPython ships in pydoc_data.topics. Every Python install has it, so training needs no
download. Deterministic: documents are sorted by their path relative to the stdlib folder.

    python data/pystdlib/prepare.py [--vocab_size 4096] [--out_dir data/pystdlib]
"""
import argparse
import os
import sys
import sysconfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from data import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# Folders inside the stdlib that are not the stdlib: installed packages and bytecode caches.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_documents():
    """Returns (documents, skipped names, source description) for this Python.
    Files that are not UTF-8 (a few tests ship latin-1 or koi8-r on purpose) are skipped."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        for fn in sorted(names):
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                files.append(("stdlib/" + os.path.relpath(path, root).replace(os.sep, "/"), path))
    files.sort()  # by relative name, so the order does not depend on os.walk
    docs, skipped = common.file_documents(files, undecodable="skip")
    try:
        from pydoc_data.topics import topics  # the text of help('keywords'), help('if'), ...
    except ImportError:
        topics = {}  # some distributions strip it; the sources alone are plenty
    for key in sorted(topics):
        docs.append((f"pydoc_data.topics/{key}", (lambda t=topics[key]: t)))
    version = ".".join(map(str, sys.version_info[:3]))
    source = f"Python {version} standard library at {root} (.py files) + pydoc_data.topics"
    return docs, skipped, source


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", default=HERE)
    p.add_argument("--vocab_size", type=int, default=4096)
    p.add_argument("--model_type", default="bpe", choices=["bpe", "unigram", "char"])
    p.add_argument("--val_fraction", type=float, default=0.05)
    p.add_argument("--min_val_tokens", type=int, default=1025,
                   help="the validation split holds at least this many tokens (one block + 1)")
    p.add_argument("--sample_bytes", type=int, default=4_000_000,
                   help="size of the seeded line sample the tokenizer is trained on")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)

    def body(_):
        docs, skipped, source = stdlib_documents()
        if skipped:
            print(f"skipping {len(skipped)} files that are not UTF-8: {', '.join(skipped)}")
        return common.prepare(args.out_dir, "pystdlib", docs, source, vocab_size=args.vocab_size,
                              model_type=args.model_type, val_fraction=args.val_fraction,
                              min_val_tokens=args.min_val_tokens, sample_bytes=args.sample_bytes,
                              seed=args.seed, skipped=skipped)
    return common.run(body, argv)


if __name__ == "__main__":
    main()
