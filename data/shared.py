"""What every stage of data/ shares, so that none imports another just for these and the
imports stay one-way: the special token ids, the names of the outputs, small helpers."""
import numpy as np

OUTPUTS = ("train.bin", "val.bin", "tokenizer.model", "tokenizer.vocab", "meta.json")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def dtype_for_vocab(vocab_size):
    # ids run from 0 to vocab_size - 1; uint16 holds up to 65535.
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def mix64(a, b):
    """A 64-bit hash of two uint64 arrays (splitmix64 finalizer): seeded keys that are the
    same on every machine and for any batching, unlike a stream of random draws."""
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
        x = np.asarray(a, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x = x ^ np.asarray(b, dtype=np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def cut_point(text, limit):
    """Where to cut text longer than limit: after the last newline before limit (a newline
    is a token of its own, so both sides encode exactly as the whole would), else before the
    last space, else at limit."""
    i = text.rfind("\n", 0, limit)
    if i >= 0:
        return i + 1
    i = text.rfind(" ", 1, limit)
    return i if i > 0 else limit
