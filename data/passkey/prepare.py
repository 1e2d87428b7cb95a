"""Passkey retrieval: documents that teach a model to recall a 5-digit key stated once, and the
prompts eval.py --passkey asks (one copy, here). A document is filler with "The pass key is
48213. Remember it." after a random fraction of it and "What is the pass key? The pass key is
48213" at the end. The filler is a stream of the words of help()'s text (pydoc_data.topics, as
data/pystdlib; else the builtins' docstrings) without those holding a digit, so the key is the
only number. Lengths count filler words; a --seed gives the same bytes on one Python version.

--keys=N (multi-key retrieval, RULER's multi-key needle): each document states a count of keys
drawn uniformly from 1..N, each named by its own label ("The pass key for tiger is 48213.
Remember it.", labels drawn from LABELS, keys distinct), each after its own random fraction of
the filler, and asks one of them ("What is the pass key for tiger? The pass key for tiger is
48213"). --keys=1 (the default) writes today's unlabelled documents, the same bytes.

    python data/passkey/prepare.py [--out_dir passkey] [--docs 20000] [--min_len 50] [--max_len 400]
        [--keys 1]
"""
import argparse
import builtins
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data import pipeline  # noqa: E402
from data.pystdlib.prepare import pydoc_topics  # noqa: E402
from harness.common import UserError  # noqa: E402

KEY, QUESTION = "The pass key is {}. Remember it.", "What is the pass key? The pass key is"
LABELLED_KEY = "The pass key for {} is {}. Remember it."
LABELLED_QUESTION = "What is the pass key for {0}? The pass key for {0} is"
# Common nouns without digits that help()'s text never uses, so the question's label is found
# only in its own key sentence; --keys is at most their count (one key per label).
LABELS = ("apple", "cherry", "tiger", "zebra", "violin", "meadow", "pepper", "lemon", "walrus",
          "falcon", "orchid", "maple", "badger", "otter", "mango", "parrot")


def check_keys(keys):
    if not 1 <= keys <= len(LABELS):
        raise UserError(f"--keys must be between 1 and {len(LABELS)} (one key per label), "
                        f"got {keys}")


def draw_labelled(rng, count, key):
    """The asked key's label and `count` - 1 more (fraction, label, key): labels distinct,
    keys distinct from each other and from `key`."""
    labels, taken, others = rng.sample(LABELS, count), {key}, []
    for label in labels[1:]:
        other = key
        while other in taken:
            other = rng.randint(10000, 99999)
        taken.add(other)
        others.append((rng.random(), label, other))
    return labels[0], tuple(others)


def filler_words():
    texts = pydoc_topics() or [getattr(builtins, n).__doc__ or "" for n in sorted(dir(builtins))]
    return [w for t in texts for w in t.split() if not any(c.isdigit() for c in w)]


def passkey_text(words, start, n, depth, key, label=None, others=()):
    """n filler words from words[start] on (wrapping round), the key sentence after
    round(depth * n) of them, then the question without its answer. label names the asked key
    (None: today's unlabelled sentence and question); others: more (fraction, label, key), each
    sentence after round(fraction * n) filler words (after the asked one where they tie)."""
    filler = [words[(start + i) % len(words)] for i in range(n)]
    sentence = KEY.format(key) if label is None else LABELLED_KEY.format(label, key)
    needles = sorted([(round(depth * n), 0, sentence)] + [(round(f * n), i, LABELLED_KEY.format(
        lab, k)) for i, (f, lab, k) in enumerate(others, 1)])
    out, done = [], 0
    for at, _, text in needles:
        out, done = out + filler[done:at] + [text], at
    question = QUESTION if label is None else LABELLED_QUESTION.format(label)
    return " ".join(out + filler[done:] + [question])


def prompt_ids(sp, words, start, length, depth, key, label=None, others=()):
    """The end-of-document token (as every training document is read), then the passkey text
    with the most filler words that keep it within `length` tokens (bisection on the count)."""
    def ids(n):
        return [sp.eos_id()] + sp.encode(passkey_text(words, start, n, depth, key, label, others))
    lo, hi = 0, length  # a word is at least a token
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(ids(mid)) <= length else (lo, mid - 1)
    if len(ids(lo)) > length:
        keys = f" with {len(others) + 1} keys" if others else ""
        raise UserError(f"length {length} is too short for a passkey prompt{keys} "
                        f"({len(ids(0))} tokens without filler)")
    return ids(lo)


def documents(n_docs, min_len, max_len, seed, keys=1):
    """keys > 1: each document states rng.randint(1, keys) labelled keys (see the top)."""
    rng, words = random.Random(seed), filler_words()
    for _ in range(n_docs):
        key, start = rng.randint(10000, 99999), rng.randrange(len(words))
        n = rng.randint(min_len, max_len)
        # with --keys > 1 a document's single key is labelled too: every question names one
        label, others = draw_labelled(rng, rng.randint(1, keys), key) if keys > 1 else (None, ())
        yield f"{passkey_text(words, start, n, rng.random(), key, label, others)} {key}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", default="passkey", help=pipeline.OUT_DIR_HELP)
    p.add_argument("--docs", type=int, default=20000, help="how many documents")
    p.add_argument("--min_len", type=int, default=50, help="filler words in a document, at least")
    p.add_argument("--max_len", type=int, default=400, help="filler words in a document, at most")
    p.add_argument("--keys", type=int, default=1, help="labelled keys in a document, at most "
                   "(1: today's single unlabelled key)")
    pipeline.add_arguments(p, vocab_size=1024)  # its --seed also draws the documents
    args = p.parse_args(argv)

    def body(_):
        if args.docs < 1 or not 0 <= args.min_len <= args.max_len:
            raise UserError("need --docs >= 1 and 0 <= --min_len <= --max_len")
        check_keys(args.keys)
        docs = [("passkey", "docs", lambda: documents(args.docs, args.min_len, args.max_len,
                                                      args.seed, args.keys))]
        return pipeline.prepare(pipeline.resolve_out_dir(args.out_dir), "passkey", docs,
                                f"{args.docs} passkey documents", **pipeline.prepare_options(args))
    return pipeline.run(body, argv)


if __name__ == "__main__":
    main()
