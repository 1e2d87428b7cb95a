"""data/recall/prepare.py and bench/studies/length.py: every question of a training document is
answered by its own needle (read back with a regular expression, not the generator's code), a
prompt has the length and the depth asked, a character is a token, the study's teacher-forced
score is greedy decoding's (an uncached forward against eval.py's cached decode), and the
study runs end to end and resumes; mistakes are one line."""
import importlib.util
import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from data.recall import prepare as recall  # noqa: E402
from harness.common import UserError  # noqa: E402


def load_length():
    path = os.path.join(REPO, "bench", "studies", "length.py")
    spec = importlib.util.spec_from_file_location("length", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NAME = f"[{re.escape(recall.KEYS)}]"
NEEDLE = re.compile(rf"({NAME})(\d{{{recall.DIGITS}}})")


def test_every_question_is_answered_by_its_own_needle():
    docs = list(recall.documents(400, 127, 4, seed=7))
    counts = set()
    for doc in docs:
        assert len(doc) <= 127
        body, _, tail = doc.partition("?")
        needles = dict(NEEDLE.findall(body))
        questions = NEEDLE.findall("?" + tail)
        assert re.fullmatch(rf"([a-z]|{NAME}\d{{{recall.DIGITS}}})*", body)  # filler + needles
        assert re.fullmatch(rf"(\?{NAME}\d{{{recall.DIGITS}}})+", "?" + tail)  # questions only
        assert len(needles) == len(NEEDLE.findall(body))  # names distinct in a document
        assert sorted(k for k, _ in questions) == sorted(needles)  # each asked once
        assert all(needles[k] == v for k, v in questions)
        assert all(len(set(v)) == recall.DIGITS for v in needles.values())  # distinct digits
        counts.add(len(needles))
    assert counts == {1, 2, 3, 4}
    assert docs == list(recall.documents(400, 127, 4, seed=7))  # a seed, the same documents


@pytest.mark.parametrize("length", [32, 128, 2048])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("count", [1, 4])
def test_a_prompt_has_the_length_and_depth_asked(length, depth, count):
    rng = random.Random(length)
    for _ in range(5):
        text, answer = recall.prompt(rng, length, depth, count)
        assert 1 + len(text) + len(answer) == length  # end-of-document token first
        assert text[-2] == "?" and text.count("?") == 1
        asked = text[-1]
        needles = {m.group(1): m for m in NEEDLE.finditer(text[:-2])}
        assert len(needles) == count and needles[asked].group(2) == answer
        filler = sum(c.islower() for c in text)
        before = sum(c.islower() for c in text[:needles[asked].start()])
        assert before == round(depth * filler)
        assert filler == length - 1 - count * recall.NEEDLE - (1 + recall.NEEDLE)


def test_prepare_writes_a_character_dataset(tmp_path):
    import numpy as np
    import sentencepiece as spm
    out = tmp_path / "recall"
    r = subprocess.run([sys.executable, os.path.join(REPO, "data", "recall", "prepare.py"),
                        f"--out_dir={out}", "--docs=400"], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    doc = next(recall.documents(1, 127, 1, seed=1337))
    assert len(sp.encode(doc)) == len(doc)  # a character is a token
    ids = np.concatenate([np.fromfile(out / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    texts = set(recall.documents(400, 127, 1, seed=1337))
    cut = np.flatnonzero(ids == sp.eos_id())  # every document ends with one
    read = {sp.decode(ids[a + 1:b].tolist()) for a, b in zip(np.r_[-1, cut[:-1]], cut)}
    assert len(read & texts) > 390  # the documents, whole; the split may cut one in two
    assert all(any(t.startswith(p) or t.endswith(p) for t in texts) for p in read - texts)


def test_mistakes_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "data", "recall", "prepare.py"),
                        f"--out_dir={tmp_path / 'x'}", "--max_len=30", "--needles=4"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: --max_len 30 is too short for 4 needles and their questions (44 characters)"]
    assert not (tmp_path / "x").exists()
    with pytest.raises(UserError, match="length 20 is too short"):
        recall.prompt(random.Random(0), 20, 0.5, 4)
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "studies", "length.py"),
                        "--designs=rope,alibi"], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: unknown design 'alibi' (known: " + ", ".join(load_length().DESIGNS) + ")"]


def test_the_teacher_forced_score_is_greedy_decodings(tmp_path):
    """accuracy() reads one uncached forward; eval.py's greedy() decodes with the KV cache,
    one token at a time. A prompt whose answer is what greedy decodes scores 1, and 0 with
    one answer token changed; per_digit() then loses that digit alone."""
    from eval import greedy
    from model import RoFormer, RoFormerConfig
    length = load_length()
    torch.manual_seed(0)
    model = RoFormer(RoFormerConfig(n_layer=2, n_head=2, n_embd=32, block_size=64,
                                    vocab_size=40, nope_every=2)).eval()
    prompts = torch.randint(3, 40, (3, 60))
    rows, answers = [], []
    for p in prompts:
        answer = greedy(model, p.tolist(), None, 40)[:4]
        rows.append(torch.cat([p, torch.tensor(answer)]))
        answers.append(answer)
    ids, answers = torch.stack(rows), torch.tensor(answers)
    assert length.accuracy(model, {0.5: (ids, 4, answers)}, batch=2)[0.5][0] == 1.0
    wrong = answers.clone()
    wrong[:, 2] = (wrong[:, 2] + 1) % 40
    assert length.accuracy(model, {0.5: (ids, 4, wrong)}, batch=2)[0.5][0] == 0.0
    assert length.per_digit(model, {0.5: (ids, 4, answers)}, batch=2) == [1.0] * 4
    assert length.per_digit(model, {0.5: (ids, 4, wrong)}, batch=2) == [1.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("design", [{}, {"window": 8, "global_every": 2}])
def test_the_attention_read_is_the_models(design):
    """explicit_attention (weights computed in float32, kept) gives the logits of torch's
    SDPA, plain causal and windowed; the needle's weight is read at the question's name."""
    from unittest.mock import patch
    from model import RoFormer, RoFormerConfig
    length = load_length()
    torch.manual_seed(0)
    model = RoFormer(RoFormerConfig(n_layer=2, n_head=2, n_embd=32, block_size=64,
                                    vocab_size=40, **design)).eval()
    ids = torch.randint(3, 40, (2, 50))
    want, _ = model(ids)
    kept = []
    with patch.object(torch.nn.functional, "scaled_dot_product_attention",
                      length.explicit_attention(kept, 45)):
        got, _ = model(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(kept) == 2 and kept[-1].shape == (2, 2, 50)
    torch.testing.assert_close(kept[-1].sum(-1), torch.ones(2, 2))  # one query's weights
    assert (kept[-1][..., 46:] == 0).all()  # causal: nothing after the query
    if design:  # the first layer is local: 8 keys, itself and the 7 before
        assert (kept[0][..., :38] == 0).all() and (kept[0][..., 38:46] > 0).all()


def test_the_study_runs_end_to_end_and_resumes(tmp_path):
    out, data = tmp_path / "out", tmp_path / "data"
    argv = [sys.executable, os.path.join(REPO, "bench", "studies", "length.py"), f"--out={out}",
            f"--data={data}", "--docs=600", "--designs=rope,yarn,drope", "--seeds=1",
            "--iters=3", "--recal=0.5", "--samples=2", "--jobs=2"]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    cells = {(x["design"], x["multiple"], x["depth"]) for x in res["rows"]}
    assert len(cells) == 3 * 3 * 5
    assert all(0 <= x["needle_attention"] <= 1 and x["accuracy"] in (0, 0.5, 1)
               for x in res["rows"])
    ckpt = torch.load(out / "runs" / "drope_s1337" / "ckpt.pt", weights_only=True)
    assert ckpt["model_args"]["nope_every"] == 1 and ckpt["iter_num"] == 2  # round(0.5 * 3)
    assert ckpt["config"]["init_from"].endswith("rope_s1337")
    # yarn reads rope's run: the same model at 1x (factor 1), so the same answers
    rows = {(x["design"], x["multiple"], x["depth"]): x["accuracy"] for x in res["rows"]}
    assert all(rows["yarn", 1, d] == rows["rope", 1, d] for d in (0.0, 0.5, 1.0))
    assert (out / "tables.md").read_text().startswith("| design |")
    again = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert again.returncode == 0 and "$ train.py" not in again.stdout  # every run reused
    digits = subprocess.run(argv + ["--collect", "--digits=4"], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    rows = [ln.split(" | ") for ln in digits.stdout.splitlines() if ln.startswith("| yarn |")]
    assert digits.returncode == 0 and len(rows) == 1 and len(rows[0]) == 6, digits.stdout
