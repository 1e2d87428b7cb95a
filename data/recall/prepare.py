"""Recall: documents that teach a small model to fetch a value stated once, and the prompts
bench/studies/length.py asks at 1x to 16x the training length (one copy, here).

A document is filler (the alphabet over and over, from a random letter) with needles inserted
at random fractions of it, then one question per needle, in a random order:

    qrstuK7302vwxyzabcdefghijklmno?K7302                  (--needles=1, the default)
    qrstuK7302vwxyzabR5518cdefg ... ?R5518?K7302          (--needles=4: 1 to 4 of them)

A needle is a name (one capital, KEYS) and its value (DIGITS distinct digits); a question is
"?", the name, then the value. Letters, names, digits and "?" are disjoint sets of characters,
so a value is found by its name alone. Filler that the previous letter predicts costs nothing
once learned, and most documents are short (a far needle is learned from near ones): without
these a 2-core CPU does not teach the copy in minutes (docs/LOG.md, 2026-12-07). Documents are
character-tokenized: a character is a token, and a document of `max_len` characters fills a
window of max_len + 1 with its end-of-document token. A --seed gives the same bytes on one
Python version.

    python data/recall/prepare.py [--out_dir recall] [--docs 200000] [--max_len 127] [--needles 1]
"""
import argparse
import os
import random
import string
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data import pipeline  # noqa: E402
from harness.common import UserError  # noqa: E402

FILLER = string.ascii_lowercase
# Names: 26 capitals and 30 of Latin-1's, so that two documents in one training window rarely
# share a name (a shared one is two values for one name, which no model can settle).
KEYS = string.ascii_uppercase + "ÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏÐÑÒÓÔÕÖØÙÚÛÜÝÞ"
DIGITS = 4
QUESTION = "?"
NEEDLE = 1 + DIGITS  # characters of a needle, and of a question with its answer (+ "?")


def needle_chars(n_needles):
    """Characters a document's needles and questions take besides its filler."""
    return n_needles * (NEEDLE + 1 + NEEDLE)


def recall_text(rng, n_filler, needles, asked=None):
    """n_filler letters of the alphabet in order (from a random one) with `needles`
    [(fraction, name, value)] inserted after round(fraction * n_filler) of them; then the
    questions: with asked=None every needle's, with its answer, in a random order (a training
    document); else only the question naming `asked`, without its answer (a prompt)."""
    first = rng.randrange(len(FILLER))
    filler = [FILLER[(first + i) % len(FILLER)] for i in range(n_filler)]
    out, done = [], 0
    for at, name, value in sorted((round(f * n_filler), k, v) for f, k, v in needles):
        out, done = out + filler[done:at] + [name + value], at
    out += filler[done:]
    if asked is not None:
        return "".join(out) + QUESTION + asked
    order = [(k, v) for _, k, v in needles]
    rng.shuffle(order)
    return "".join(out) + "".join(QUESTION + k + v for k, v in order)


def draw_needles(rng, count):
    """count needles [(fraction, name, value)]: names distinct, a value DIGITS distinct digits
    (so that each answer digit follows one place in the document: the one to copy)."""
    names = rng.sample(KEYS, count)
    return [(rng.random(), k, "".join(rng.sample(string.digits, DIGITS))) for k in names]


def documents(n_docs, max_len, max_needles, seed):
    """Training documents: 1..max_needles needles, filler so the whole is at most max_len, its
    length u^2 of the most (u uniform): a third of it on average."""
    rng = random.Random(seed)
    for _ in range(n_docs):
        count = rng.randint(1, max_needles)
        # short documents are most (a far needle is learned from near ones), long ones reach B
        n_filler = int((max_len - needle_chars(count) + 1) * rng.random() ** 2)
        yield recall_text(rng, n_filler, draw_needles(rng, count))


def prompt(rng, length, depth, n_needles):
    """(text, answer) whose end-of-document token, text and answer are `length` tokens: the
    asked needle after round(depth * filler) letters, n_needles - 1 more at random fractions."""
    n_filler = length - 1 - n_needles * NEEDLE - (1 + NEEDLE)
    if n_filler < 0:
        raise UserError(f"length {length} is too short for a prompt with {n_needles} needles "
                        f"({length - n_filler} tokens without filler)")
    needles = draw_needles(rng, n_needles)
    needles[0] = (depth,) + needles[0][1:]
    text = recall_text(rng, n_filler, needles, asked=needles[0][1])
    return text, needles[0][2]


def check_options(docs, max_len, needles):
    if docs < 1 or not 1 <= needles <= len(KEYS):
        raise UserError(f"need --docs >= 1 and 1 <= --needles <= {len(KEYS)}")
    if max_len < needle_chars(needles):
        raise UserError(f"--max_len {max_len} is too short for {needles} needles and their "
                        f"questions ({needle_chars(needles)} characters)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", default="recall", help=pipeline.OUT_DIR_HELP)
    p.add_argument("--docs", type=int, default=200000, help="how many documents")
    p.add_argument("--max_len", type=int, default=127,
                   help="characters in a document, at most (127: with its end, a 128 window)")
    p.add_argument("--needles", type=int, default=1,
                   help="needles in a document, at most (1: the passkey task, one value to find)")
    pipeline.add_arguments(p, vocab_size=0)  # its --seed also draws the documents
    args = p.parse_args(argv)

    def body(_):
        check_options(args.docs, args.max_len, args.needles)
        docs = [("recall", "docs", lambda: documents(args.docs, args.max_len, args.needles,
                                                     args.seed))]
        options = pipeline.prepare_options(args)
        if not args.tokenizer:
            options.update(model_type="char")  # every character of the sample + bytes
        return pipeline.prepare(pipeline.resolve_out_dir(args.out_dir), "recall", docs,
                                f"{args.docs} recall documents", **options)
    return pipeline.run(body, argv)


if __name__ == "__main__":
    main()
