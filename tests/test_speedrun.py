"""bench/speed/speedrun.py end to end against a stand-in nanoGPT checkout (a bigram model by counts,
written here: nanoGPT itself is not in this repository): both sides prepared from one text,
timed in pairs, and each final checkpoint scored on nanoGPT's held-out characters, checked
against a naive float64 computation of the same mean loss."""
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEEDRUN = os.path.join(ROOT, "bench", "speed", "speedrun.py")

PREPARE = """
import os, pickle, numpy as np
here = os.path.dirname(__file__)
data = open(os.path.join(here, "input.txt")).read()
chars = sorted(set(data))
stoi = {c: i for i, c in enumerate(chars)}
n = len(data)
for name, part in (("train", data[:int(n * 0.9)]), ("val", data[int(n * 0.9):])):
    np.array([stoi[c] for c in part], dtype=np.uint16).tofile(os.path.join(here, name + ".bin"))
pickle.dump({"vocab_size": len(chars), "stoi": stoi}, open(os.path.join(here, "meta.pkl"), "wb"))
"""

MODEL = """
from dataclasses import dataclass
import torch, torch.nn as nn, torch.nn.functional as F

@dataclass
class GPTConfig:
    vocab_size: int = 1

class GPT(nn.Module):  # a bigram table: logits of the next character given this one
    def __init__(self, config):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(config.vocab_size, config.vocab_size))

    def forward(self, idx, targets):
        logits = self.table[idx]
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
"""

TRAIN = """
import os, sys, pickle, numpy as np, torch
args = dict(a[2:].split("=", 1) for a in sys.argv[2:])
d = os.path.join("data", args["dataset"])
vocab = pickle.load(open(os.path.join(d, "meta.pkl"), "rb"))["vocab_size"]
ids = np.fromfile(os.path.join(d, "train.bin"), dtype=np.uint16)
counts = np.ones((vocab, vocab))
np.add.at(counts, (ids[:-1], ids[1:]), 1)
table = torch.tensor(np.log(counts / counts.sum(1, keepdims=True)), dtype=torch.float32)
os.makedirs(args["out_dir"], exist_ok=True)
torch.save({"model": {"table": table}, "model_args": {"vocab_size": vocab}, "iter_num": 2000},
           os.path.join(args["out_dir"], "ckpt.pt"))
print("step 2000: train loss 2.0000, val loss 2.5000")
"""


@pytest.fixture
def nanogpt(tmp_path):
    d = tmp_path / "nanogpt"
    (d / "data" / "shakespeare_char").mkdir(parents=True)
    (d / "data" / "shakespeare_char" / "prepare.py").write_text(PREPARE)
    (d / "model.py").write_text(MODEL)
    (d / "train.py").write_text(TRAIN)
    return d


def text():
    rng = np.random.default_rng(0)
    words = ["the", "rope", "turns", "keys", "and", "queries", "by", "angles", "of", "position"]
    lines = [" ".join(rng.choice(words, 8)) for _ in range(700)]
    return "\n".join(lines[:300]) + "\n\n" + "\n".join(lines[300:]) + "\n"


def speedrun(*args, cwd=ROOT):
    return subprocess.run([sys.executable, SPEEDRUN, *args], capture_output=True, text=True,
                          cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"))


def naive_loss(logprob, ids, window=64):
    """-log p(next | context) in float64, one character at a time, over the windows laid end to
    end: `logprob(context, next)` for each of the (len - 1) // window * window predictions."""
    n = (len(ids) - 1) // window * window
    return sum(-logprob(ids[i - i % window:i + 1], ids[i + 1]) for i in range(n)) / n


def test_pairs_are_timed_and_both_sides_scored_on_nanogpts_held_out_characters(nanogpt,
                                                                             tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text(text())
    work = tmp_path / "work"
    r = speedrun(f"--nanogpt={nanogpt}", f"--text={corpus}", "--name=t", "--seeds=2",
                 f"--work={work}", "--flags=--max_iters=6 --short_iters=2 --log_interval=1")
    assert r.returncode == 0, r.stderr[-3000:]
    [result] = json.loads((work / "t" / "results.json").read_text())
    assert result["paired"] and [p["seed"] for p in result["pairs"]] == [1337, 1338]
    ratios = [p["ours_s"] / p["nanogpt_s"] for p in result["pairs"]]
    assert result["ratio"] == pytest.approx(sum(ratios) / 2)
    # nanoGPT's split, to the character: the last 10% of the text as its prepare cut it
    held_out = text()[int(len(text()) * 0.9):]
    chars = sorted(set(text()))
    ids = [chars.index(c) for c in held_out]
    table = torch.load(work / "t" / "nanogpt" / "ckpt.pt")["model"]["table"].double()
    lsm = torch.log_softmax(table, -1)
    want = naive_loss(lambda ctx, nxt: lsm[ctx[-1], nxt].item(), ids)
    for p in result["pairs"]:
        assert p["nanogpt_scored"] == pytest.approx(want, abs=1e-5)
        assert p["nanogpt_printed"] == 2.5
    # ours: our own checkpoint, each prediction made from its window's context alone
    sys.path.insert(0, ROOT)
    from harness.load import load_run
    for p in result["pairs"]:
        model, sp, ckpt = load_run(str(work / "t" / f"ours-{p['seed']}"), "cpu", "float64")
        assert ckpt["iter_num"] == 6 and ckpt["config"]["seed"] == p["seed"]
        ours = sp.encode(held_out)
        assert len(ours) == len(held_out)
        with torch.no_grad():
            def logprob(ctx, nxt):
                logits = model(torch.tensor([ctx]))[0][0, -1]
                return torch.log_softmax(logits.double(), -1)[nxt].item()
            want = naive_loss(logprob, ours[:64 * 3 + 1])  # the first 3 windows, char by char
            x = torch.tensor(ours[:64 * 3 + 1])
            got = model(x[:-1].view(3, 64), x[1:].view(3, 64))[1].item()
        assert got == pytest.approx(want, abs=1e-6)  # the windows' mean is the naive mean
        assert p["ours_scored"] == pytest.approx(_windows_mean(model, ours), abs=1e-4)
    from scipy import stats
    losses = [p["ours_scored"] for p in result["pairs"]]
    assert result["p"] == pytest.approx(stats.ttest_1samp(
        losses, result["target"], alternative="less").pvalue)
    assert "scored on nanoGPT's held-out" in r.stdout


def _windows_mean(model, ids, window=64):
    n = (len(ids) - 1) // window * window
    x = torch.tensor(ids[:n + 1])
    with torch.no_grad():
        return model(x[:-1].view(-1, window), x[1:].view(-1, window))[1].item()


def test_mistakes_are_one_line(nanogpt, tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text(text())
    for args, said in (([f"--text={corpus}"], "--nanogpt=DIR"),
                       ([f"--nanogpt={nanogpt}"], "--text=FILE_OR_FOLDER"),
                       ([f"--nanogpt={nanogpt}", f"--text={tmp_path / 'none'}"],
                        "is not a file or a folder"),
                       ([f"--nanogpt={nanogpt}", f"--text={corpus}", "--nanogpt_runs=0",
                         f"--work={tmp_path / 'w'}"], "needs an earlier run of this text")):
        r = speedrun(*args)
        assert r.returncode == 1 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
