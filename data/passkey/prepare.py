"""Passkey retrieval: documents that teach a model to recall a 5-digit key stated once, and the
prompts eval.py --passkey asks (one copy, here). A document is filler with "The pass key is
48213. Remember it." after a random fraction of it and "What is the pass key? The pass key is
48213" at the end. The filler is a stream of the words of help()'s text (pydoc_data.topics, as
data/pystdlib; else the builtins' docstrings) without those holding a digit, so the key is the
only number. Lengths count filler words; a --seed gives the same bytes on one Python version.

    python data/passkey/prepare.py [--out_dir passkey] [--docs 20000] [--min_len 50] [--max_len 400]
"""
import argparse
import builtins
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data import common  # noqa: E402
from data.pystdlib.prepare import pydoc_topics  # noqa: E402
from lib.common import UserError  # noqa: E402

KEY, QUESTION = "The pass key is {}. Remember it.", "What is the pass key? The pass key is"


def filler_words():
    texts = pydoc_topics() or [getattr(builtins, n).__doc__ or "" for n in sorted(dir(builtins))]
    return [w for t in texts for w in t.split() if not any(c.isdigit() for c in w)]


def passkey_text(words, start, n, depth, key):
    """n filler words from words[start] on (wrapping round), the key sentence after
    round(depth * n) of them, then the question without its answer."""
    filler, at = [words[(start + i) % len(words)] for i in range(n)], round(depth * n)
    return " ".join(filler[:at] + [KEY.format(key)] + filler[at:] + [QUESTION])


def prompt_ids(sp, words, start, length, depth, key):
    """The end-of-document token (as every training document is read), then the passkey text
    with the most filler words that keep it within `length` tokens (bisection on the count)."""
    def ids(n):
        return [sp.eos_id()] + sp.encode(passkey_text(words, start, n, depth, key))
    lo, hi = 0, length  # a word is at least a token
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(ids(mid)) <= length else (lo, mid - 1)
    if len(ids(lo)) > length:
        raise UserError(f"length {length} is too short for a passkey prompt ({len(ids(0))} "
                        f"tokens without filler)")
    return ids(lo)


def documents(n_docs, min_len, max_len, seed):
    rng, words = random.Random(seed), filler_words()
    for _ in range(n_docs):
        key, start = rng.randint(10000, 99999), rng.randrange(len(words))
        n = rng.randint(min_len, max_len)
        yield f"{passkey_text(words, start, n, rng.random(), key)} {key}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", default="passkey", help=common.OUT_DIR_HELP)
    p.add_argument("--docs", type=int, default=20000, help="how many documents")
    p.add_argument("--min_len", type=int, default=50, help="filler words in a document, at least")
    p.add_argument("--max_len", type=int, default=400, help="filler words in a document, at most")
    common.add_arguments(p, vocab_size=1024)  # its --seed also draws the documents
    args = p.parse_args(argv)

    def body(_):
        if args.docs < 1 or not 0 <= args.min_len <= args.max_len:
            raise UserError("need --docs >= 1 and 0 <= --min_len <= --max_len")
        docs = [("passkey", "docs", lambda: documents(args.docs, args.min_len, args.max_len,
                                                      args.seed))]
        return common.prepare(common.resolve_out_dir(args.out_dir), "passkey", docs,
                              f"{args.docs} passkey documents", **common.prepare_options(args))
    return common.run(body, argv)


if __name__ == "__main__":
    main()
