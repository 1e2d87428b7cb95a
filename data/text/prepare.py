"""Your own text: files and folders -> data/<out_dir>/{train,val}.bin, tokenizer.model, meta.json.

    python data/text/prepare.py --input notes/ book.txt --out_dir data/mytext --vocab_size 8000

A document is a file (folders are read recursively in sorted order; hidden entries and
__pycache__ are left out).
A corpus of a single file is split into documents at blank lines (paragraphs), so it still
gets a document-level train/val split.
"""
import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from data import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or folders")
    p.add_argument("--out_dir", default=HERE, help="default: data/text")
    p.add_argument("--ext", nargs="*", default=None, metavar="EXT",
                   help="only files in folders whose names end so (e.g. .py .md); default: all")
    p.add_argument("--vocab_size", type=int, default=None,
                   help="default 4096; for char, every character of the sample + 256 bytes")
    p.add_argument("--model_type", default="bpe", choices=["bpe", "unigram", "char"])
    p.add_argument("--val_fraction", type=float, default=0.05)
    p.add_argument("--min_val_tokens", type=int, default=1025,
                   help="the validation split holds at least this many tokens (one block + 1)")
    p.add_argument("--undecodable", default="fail", choices=["fail", "skip"],
                   help="a file that is not UTF-8 stops the run (fail) or is left out (skip)")
    p.add_argument("--sample_bytes", type=int, default=4_000_000,
                   help="size of the seeded line sample the tokenizer is trained on")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)

    def body(_):
        files = common.find_files(args.input, args.ext)
        docs, skipped = common.file_documents(files, args.undecodable)
        for name in skipped:
            print(f"warning: skipping {name}: not valid UTF-8")
        vocab = args.vocab_size
        if vocab is None:
            vocab = 0 if args.model_type == "char" else 4096  # 0: sized by the characters seen
        out_dir = os.path.abspath(args.out_dir)
        return common.prepare(out_dir, os.path.basename(out_dir), docs,
                              " ".join(os.path.abspath(x) for x in args.input),
                              vocab_size=vocab, model_type=args.model_type,
                              val_fraction=args.val_fraction, min_val_tokens=args.min_val_tokens,
                              sample_bytes=args.sample_bytes, seed=args.seed, skipped=skipped)
    return common.run(body, argv)


if __name__ == "__main__":
    main()
