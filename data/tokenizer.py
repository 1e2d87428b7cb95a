"""Stage 3: the tokenizer. Its sample, drawn as the corpus streams past (the units with the
smallest seeded keys, so neither their order nor the batching matters), and sentencepiece
trained on it with the settings every dataset of this repo shares (export.py relies on them)."""
import heapq
import io
import re

from data.shared import BOS_ID, EOS_ID, UNK_ID
from harness.common import UserError

# sentencepiece's trainer records its thread count in the model and unigram's EM sums over
# one partition of the sentences per thread, so the count must not come from the machine.
TRAINER_THREADS = 16


class TokenizerSample:
    """Candidates offered as (key, source index, text): keeps those with the smallest keys
    while the others alone still fill sample_bytes characters."""

    def __init__(self, sample_bytes):
        self.sample_bytes = sample_bytes
        self.heap = []  # max-heap on key: (-key, source index, text)
        self.size = 0   # characters held

    def cutoff(self):
        """Keys at or above this can no longer enter the sample (workers drop them early)."""
        return -self.heap[0][0] if self.size >= self.sample_bytes else 1 << 64

    def offer(self, key, source, text):
        if self.size >= self.sample_bytes and key >= -self.heap[0][0]:
            return
        heapq.heappush(self.heap, (-key, source, text))
        self.size += len(text)
        # Drop the largest key while the others alone still fill the sample: it can no
        # longer be part of the sorted prefix that fits.
        while self.size - len(self.heap[0][2]) >= self.sample_bytes:
            self.size -= len(heapq.heappop(self.heap)[2])

    def texts(self, skipped_sources):
        """The units in key order that fit sample_bytes (at least one)."""
        size = 0
        for key, si, text in sorted((-k, si, t) for k, si, t in self.heap
                                    if si not in skipped_sources):
            if size + len(text) > self.sample_bytes and size:
                break
            size += len(text)
            yield text

    def lines(self, skipped_sources):
        """The sample's units as the non-blank lines to train on."""
        return [line for text in self.texts(skipped_sources) for line in text.split("\n")
                if line.strip()]


def train_tokenizer(lines, vocab_size, model_type):
    """Train sentencepiece on the given lines; returns (model bytes, settings for meta.json)."""
    import sentencepiece as spm

    if not lines:
        raise UserError("the tokenizer sample is empty (the corpus has no non-blank line)")
    settings = dict(
        model_type=model_type,
        vocab_size=vocab_size,
        # Every input encodes: characters outside the vocabulary become their UTF-8 bytes.
        byte_fallback=True,
        # Code and whitespace pass through unchanged: no NFKC, no squeezing of spaces, no
        # space added in front of the text. Runs of spaces (indentation) may become pieces.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        # Numbers as digits: keeps the vocabulary for words, the usual choice for LMs.
        split_digits=True,
        # Lines are the training sentences, so "\n" never reaches the trainer; as a fixed
        # piece it still encodes as one token instead of a byte, and no piece spans it, so
        # text cut after a newline encodes exactly as the whole (pieces, the split).
        user_defined_symbols=["\n"],
        character_coverage=1.0 if model_type == "char" else 0.9999,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
        input_sentence_size=0,  # use the whole sample: it is drawn (and bounded) by us
        max_sentence_length=1 << 16,
    )
    if model_type == "char" and not vocab_size:
        # Every character of the sample, the 256 byte pieces, unk/bos/eos and "\n".
        settings["vocab_size"] = len(set().union(*lines)) + 256 + 4
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                       num_threads=TRAINER_THREADS, minloglevel=2, **settings)
    except RuntimeError as e:
        raise trainer_error(e, settings["vocab_size"])
    settings["user_defined_symbols"] = ["\\n"]  # readable in meta.json
    settings["trainer_threads"] = TRAINER_THREADS
    return model.getvalue(), settings


def trainer_error(e, vocab_size):
    """sentencepiece's RuntimeError as the UserError that says which --vocab_size to pass."""
    msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
    m = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg)
    if m:
        return UserError(f"vocab_size {m.group(1)} is too small for this corpus: its characters "
                         f"and the special and byte pieces need {m.group(2)}; pass a larger "
                         f"--vocab_size")
    if "Vocabulary size" in msg:
        m = re.search(r"value <= (\d+)", msg)
        limit = f" (at most {m.group(1)} here)" if m else ""
        return UserError(f"vocab_size {vocab_size} is too large for this corpus{limit}; pass a "
                         f"smaller --vocab_size")
    return UserError(f"sentencepiece failed: {msg}")


def load_tokenizer(model_bytes):
    import sentencepiece as spm
    return spm.SentencePieceProcessor(model_proto=model_bytes)


# What a normalising model changes (NFKC, squeezed or stripped spaces) in any corpus: runs of
# spaces, leading and trailing ones, blank lines, indented code.
ROUND_TRIP_PROBES = ("a  b", " a ", "a\n\n  b  \n", "def f(x):\n    return x  # y\n")


def check_round_trip(sp, texts, name, what="this corpus"):
    """Refuse the tokenizer `name` unless decode(encode(text)) gives back each text, U+2581
    aside (sentencepiece's own space, which every model decodes as one): bits per byte and the
    corpus itself depend on it. The line names the first piece that changes."""
    for text in texts:
        want, got = text.replace("\u2581", " "), sp.decode(sp.encode(text))
        if got != want:
            was, became = first_difference(want, got)
            raise UserError(f"tokenizer {name} does not round-trip {what}: decode(encode(text)) "
                            f"changes {was!r} to {became!r} (a normalising model, e.g. "
                            f"nmt_nfkc); train one with data/text/prepare.py or use a run's")


def first_difference(a, b, most=30):
    """The first differing stretch of two strings, as (in a, in b): past their common prefix,
    before their common suffix, widened over the whitespace run it starts inside (a squeezed
    '  ' shows as '  ' -> ' ', not ' ' -> '') and by a neighbour when one side is empty."""
    p = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    s = 0
    while s < min(len(a), len(b)) - p and a[-1 - s] == b[-1 - s]:
        s += 1
    while p and a[p - 1].isspace() and a[p:p + 1].isspace():
        p -= 1
    ea, eb = len(a) - s, len(b) - s
    if ea == p or eb == p:  # one side empty: show a neighbour for context
        if s:
            ea, eb = ea + 1, eb + 1
        elif p:
            p -= 1
    return a[p:ea][:most], b[p:eb][:most]
