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
    """The corpus prepared twice with one seed and once with another, and with --keys=3."""
    root = tmp_path_factory.mktemp("passkey")
    script = load_script("passkey")
    for name, seed, more in (("a", 3, []), ("b", 3, []), ("c", 4, []), ("d", 3, ["--keys", "3"])):
        script.main(["--out_dir", str(root / name), "--docs", "300", "--min_len", "20",
                     "--max_len", "60", "--vocab_size", "600", "--seed", str(seed),
                     "--min_val_tokens", "200", "--num_proc", "1", *more])
    return root


def found_documents(folder):
    """The documents a prepared folder's token files decode to (each ends at the
    end-of-document token), and how many val's budget cut."""
    import numpy as np
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    ids = np.concatenate([np.fromfile(folder / f, dtype=np.uint16) for f in
                          ("train.bin", "val.bin")]).tolist()
    ends = [i for i, t in enumerate(ids) if t == sp.eos_id()]
    cut = json.loads((folder / "meta.json").read_text())["cut_documents"]
    return [sp.decode(ids[a + 1:b]) for a, b in zip([-1] + ends, ends)], cut


def test_prepare_is_the_same_bytes_for_the_same_seed(built):
    for fn in ("train.bin", "val.bin", "tokenizer.model"):
        assert (built / "a" / fn).read_bytes() == (built / "b" / fn).read_bytes(), fn
    assert (built / "a" / "train.bin").read_bytes() != (built / "c" / "train.bin").read_bytes()
    found, cut = found_documents(built / "a")
    docs = set(passkey.documents(300, 20, 60, seed=3))
    assert len(docs) == 300 and sum(f in docs for f in found) >= 300 - cut


def test_prepare_keys_writes_the_multi_key_documents(built):
    found, cut = found_documents(built / "d")
    docs = set(passkey.documents(300, 20, 60, seed=3, keys=3))
    assert len(docs) == 300 and sum(f in docs for f in found) >= 300 - cut
    assert {parse_labelled(f)[1] for f in found if f in docs} == {1, 2, 3}


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
    for keys in ("0", str(len(passkey.LABELS) + 1)):
        msg = one_line_error(script.main, ["--out_dir", str(tmp_path / "x"), "--keys", keys])
        assert f"--keys must be between 1 and {len(passkey.LABELS)}" in msg
    assert not (tmp_path / "x").exists()


# --- multi-key retrieval (issue 38): labelled keys, the question names one --------------------

def todays_text(words, start, n, depth, key):
    """The single-key text as it was before --keys, rebuilt by hand."""
    filler, at = [words[(start + i) % len(words)] for i in range(n)], round(depth * n)
    return " ".join(filler[:at] + [f"The pass key is {key}. Remember it."] + filler[at:] +
                    ["What is the pass key? The pass key is"])


def todays_documents(n_docs, min_len, max_len, seed):
    import random
    rng, words = random.Random(seed), passkey.filler_words()
    for _ in range(n_docs):
        key, start, n = rng.randint(10000, 99999), rng.randrange(len(words)), \
            rng.randint(min_len, max_len)
        yield f"{todays_text(words, start, n, rng.random(), key)} {key}"


def test_one_key_is_todays_task_byte_for_byte():
    words = passkey.filler_words()
    want = list(todays_documents(100, 0, 30, seed=11))
    assert list(passkey.documents(100, 0, 30, seed=11)) == want
    assert list(passkey.documents(100, 0, 30, seed=11, keys=1)) == want
    for start, n, depth in ((0, 0, 0.5), (17, 12, 0), (900, 40, 0.37), (5, 40, 1)):
        assert passkey.passkey_text(words, start, n, depth, 43210) == \
            todays_text(words, start, n, depth, 43210)


LABELLED = r"The pass key for ([a-z]+) is (\d+)\. Remember it\."


def parse_labelled(text):
    """({label: key} stated, the asked label, filler words before the asked key's sentence,
    filler words in all, the answer or None)."""
    stated = re.findall(LABELLED, text)
    asked = re.findall(r"What is the pass key for ([a-z]+)\? The pass key for \1 is", text)
    assert len(asked) == 1, text
    tail = text.split(f"The pass key for {asked[0]} is")[-1].split()
    before = re.sub(LABELLED, "", text.split(f"The pass key for {asked[0]} is ")[0]).split()
    filler = len(re.sub(LABELLED, "", text).split()) - 13 - len(tail)  # 13: the question
    return dict(stated), len(stated), asked[0], len(before), filler, tail[0] if tail else None


def test_multi_key_documents_ask_one_of_their_labelled_keys():
    docs = list(passkey.documents(400, 3, 40, seed=7, keys=4))
    assert docs == list(passkey.documents(400, 3, 40, seed=7, keys=4))
    counts, depths = [], []
    for doc in docs:
        keys, n_stated, asked, before, filler, answer = parse_labelled(doc)
        assert n_stated == len(keys) and set(keys) <= set(passkey.LABELS)  # a label once
        assert len(set(keys.values())) == len(keys) and all(len(k) == 5 for k in keys.values())
        assert answer == keys[asked] and doc.endswith(f" {keys[asked]}")
        assert sorted(re.findall(r"\d", doc)) == sorted("".join(keys.values()) + answer)
        assert 3 <= filler <= 40 and 0 <= before <= filler
        counts.append(len(keys))
        depths.append(before / filler)
    assert sorted(set(counts)) == [1, 2, 3, 4] and all(counts.count(c) > 60 for c in (1, 4))
    assert 0.3 < sum(depths) / len(depths) < 0.7
    words = set(passkey.filler_words())
    assert not any(label in w for label in passkey.LABELS for w in words)


@pytest.mark.parametrize("length", [120, 400])
def test_multi_key_prompts_state_each_label_once_and_place_the_asked_key(built, length):
    import random
    sp = spm.SentencePieceProcessor(model_file=str(built / "a" / "tokenizer.model"))
    words, rng = passkey.filler_words(), random.Random(length)
    for i, depth in enumerate((0, 0.3, 0.5, 1)):
        start, key = 991 * i + 3, 20000 + 7919 * i
        label, others = passkey.draw_labelled(rng, 4, key)
        ids = passkey.prompt_ids(sp, words, start, length, depth, key, label, others)
        text = sp.decode(ids)
        keys, n_stated, asked, before, filler, answer = parse_labelled(text)
        assert ids[0] == sp.eos_id() and len(ids) <= length and answer is None
        assert n_stated == 4 and keys == {label: str(key), **{o[1]: str(o[2]) for o in others}}
        assert asked == label and before == round(depth * filler)
        for frac, other, k in others:  # every other key after its own share of the filler
            head = text.split(f"The pass key for {other} is {k}.")[0]
            assert len(re.sub(LABELLED, "", head).split()) == round(frac * filler)
        assert re.sub(LABELLED, "", text).split()[:-13] == words[start:start + filler]
        longer = passkey.passkey_text(words, start, filler + 1, depth, key, label, others)
        assert len(sp.encode(longer)) + 1 > length  # one filler word more would not fit
    single = len(passkey.prompt_ids(sp, words, 0, 40, 0.5, 12345))  # fits one key, not four
    msg = one_line_error(passkey.prompt_ids, sp, words, 0, single, 0.5, 12345, label, others)
    assert "too short for a passkey prompt with 4 keys" in msg
