"""data/passkey/prepare.py: the documents (the key stated once, before the question, and the
answer equal to it; filler within the lengths asked), the same bytes for the same seed, and
the prompts eval.py --passkey builds from the same code: the longest within L tokens, the key
after the requested fraction of the filler, all counted here by hand on the text. eval.py's
side (the grid, exact-match counting, greedy decoding) is in test_eval.py."""
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
spm = pytest.importorskip("sentencepiece")
from data.passkey import prepare as passkey  # noqa: E402
from test_data import load_script  # noqa: E402
from test_eval import one_line_error  # noqa: E402

KEY_WORDS, QUESTION_WORDS = 7, 9  # "The pass key is K. Remember it." and the question


def parse(doc):
    """(key stated, filler words before it, filler words in all, the answer or None)."""
    stated = re.findall(r"The pass key is (\d+)\. Remember it\.", doc)
    assert len(stated) == 1, doc
    before = doc.split(f"The pass key is {stated[0]}.")[0].split()
    tail = doc.split("What is the pass key? The pass key is")[-1].split()
    filler = len(doc.split()) - KEY_WORDS - QUESTION_WORDS - len(tail)
    return stated[0], len(before), filler, tail[0] if tail else None


def test_documents_state_the_key_once_and_end_with_it():
    docs = list(passkey.documents(200, 3, 40, seed=7))
    assert docs == list(passkey.documents(200, 3, 40, seed=7))
    assert docs != list(passkey.documents(200, 3, 40, seed=8))
    depths = []
    for doc in docs:
        key, before, filler, answer = parse(doc)
        assert answer == key and len(key) == 5 and doc.endswith(f" {key}")
        assert re.findall(r"\d", doc) == list(key + key)  # the only digits: no number in filler
        assert doc.index(f"is {key}. Remember") < doc.index("What is the pass key?")
        assert 3 <= filler <= 40 and 0 <= before <= filler
        depths.append(before / max(filler, 1))
    assert min(depths) == 0 and max(depths) == 1 and 0.3 < sum(depths) / len(depths) < 0.7
    assert len({parse(d)[0] for d in docs}) > 190  # keys are drawn, not repeated


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The corpus prepared twice with one seed and once with another."""
    root = tmp_path_factory.mktemp("passkey")
    script = load_script("passkey")
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        script.main(["--out_dir", str(root / name), "--docs", "300", "--min_len", "20",
                     "--max_len", "60", "--vocab_size", "600", "--seed", str(seed),
                     "--min_val_tokens", "200", "--num_proc", "1"])
    return root


def test_prepare_is_the_same_bytes_for_the_same_seed(built):
    import numpy as np
    for fn in ("train.bin", "val.bin", "tokenizer.model"):
        assert (built / "a" / fn).read_bytes() == (built / "b" / fn).read_bytes(), fn
    assert (built / "a" / "train.bin").read_bytes() != (built / "c" / "train.bin").read_bytes()
    # the token files decode to the documents, each followed by the end-of-document token
    sp = spm.SentencePieceProcessor(model_file=str(built / "a" / "tokenizer.model"))
    ids = np.concatenate([np.fromfile(built / "a" / f, dtype=np.uint16) for f in
                          ("train.bin", "val.bin")]).tolist()
    docs = set(passkey.documents(300, 20, 60, seed=3))
    ends = [i for i, t in enumerate(ids) if t == sp.eos_id()]
    found = [sp.decode(ids[a + 1:b]) for a, b in zip([-1] + ends, ends)]
    cut = json.loads((built / "a" / "meta.json").read_text())["cut_documents"]  # val's budget
    assert len(docs) == 300 and sum(f in docs for f in found) >= 300 - cut


@pytest.mark.parametrize("length", [80, 200, 1000])
def test_prompts_are_the_longest_within_length_with_the_key_at_depth(built, length):
    sp = spm.SentencePieceProcessor(model_file=str(built / "a" / "tokenizer.model"))
    words = passkey.filler_words()
    for i, depth in enumerate((0, 0.1, 0.5, 0.9, 1)):
        start, key = 997 * i + 5, 10000 + 7919 * i
        ids = passkey.prompt_ids(sp, words, start, length, depth, key)
        text = sp.decode(ids)
        assert ids[0] == sp.eos_id() and len(ids) <= length
        assert text.endswith("What is the pass key? The pass key is")
        stated, before, filler, answer = parse(text)
        assert (stated, answer) == (str(key), None) and before == round(depth * filler)
        split = text.split()  # the filler: the words from `start` on, in order
        assert split[:before] + split[before + KEY_WORDS:-QUESTION_WORDS] == \
            words[start:start + filler]
        longer = [sp.eos_id()] + sp.encode(passkey.passkey_text(words, start, filler + 1, depth,
                                                                key))
        assert len(longer) > length  # one filler word more would not fit
    assert "too short for a passkey prompt" in one_line_error(
        passkey.prompt_ids, sp, words, 0, 10, 0.5, 12345)


def test_prepare_errors(tmp_path):
    script = load_script("passkey")
    for args in (["--min_len", "50", "--max_len", "10"], ["--docs", "0"]):
        msg = one_line_error(script.main, ["--out_dir", str(tmp_path / "x"), *args])
        assert "--min_len" in msg
    assert not (tmp_path / "x").exists()
