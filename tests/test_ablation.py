"""bench/studies/ablation.py: its evaluation pieces (bench/studies/extrapolation.py) against naive
recomputation, and a smoke run of the whole pipeline (the real train.py, tiny data made here)
that checks the outputs' structure."""
import csv
import importlib.util
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model import RoFormer, RoFormerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("ablation", os.path.join(ROOT, "bench", "studies", "ablation.py"))
ablation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ablation)
import extrapolation  # noqa: E402  (ablation.py put bench/studies/ on sys.path)


def tiny(**kw):
    torch.manual_seed(0)
    args = dict(vocab_size=61, block_size=8, n_layer=2, n_head=2, n_embd=16)
    args.update(kw)
    return RoFormer(RoFormerConfig(**args)).eval()


@pytest.mark.parametrize("attention,stride", [("softmax", 1), ("linear", 1), ("softmax", 3)])
def test_crop_losses_equal_one_window_at_a_time(attention, stride):
    m = tiny(attention=attention, linear_chunk=4)
    x = torch.randint(0, 61, (30,))
    got = extrapolation.crop_losses(m, x, batch=5, stride=stride)
    want = []
    with torch.no_grad():
        for t in extrapolation.scored_positions(29, 8, stride).tolist():
            logits = m(x[max(0, t - 7):t + 1][None])[0][0, -1]
            want.append(F.cross_entropy(logits, x[t + 1]))
    assert torch.allclose(got, torch.stack(want), atol=1e-5)
    if stride == 3:
        assert extrapolation.scored_positions(29, 8, 3).tolist() == list(range(8)) + [8, 11, 14, 17, 20, 23, 26]


def test_sinks_zero_is_the_plain_rolling_cache():
    m = tiny()
    x = torch.randint(0, 61, (2, 33))
    with torch.no_grad():
        plain = extrapolation.token_losses(m, x, cached=True)
        sinks = extrapolation.token_losses(extrapolation.keep_sinks(tiny(), 0), x, cached=True)
    assert torch.allclose(plain, sinks, atol=1e-5)


def test_default_variants_leave_out_the_relative_baselines():
    assert ablation.parse_args([]).variants == list(ablation.DEFAULT_VARIANTS)
    assert ablation.parse_args(["--variants=rope,t5"]).variants == ["rope", "t5"]


def test_sinks_see_the_first_positions_and_the_recent_window():
    """One layer, no position encoding: attention is then a function of the set of visible
    keys, so the prediction at position m must equal a plain forward over exactly the tokens
    0..k-1 followed by the last block_size-k tokens."""
    k, bs = 3, 8
    m = extrapolation.keep_sinks(tiny(n_layer=1, pos_encoding="none"), k)
    ref = tiny(n_layer=1, pos_encoding="none")
    x = torch.randint(0, 61, (1, 26))
    with torch.no_grad():
        got = extrapolation.token_losses(m, x, cached=True)[0]
        for t in range(25):
            ctx = x[0, :t + 1] if t < bs else torch.cat((x[0, :k], x[0, t - (bs - k) + 1:t + 1]))
            want = F.cross_entropy(ref(ctx[None])[0][0, -1], x[0, t + 1])
            assert abs(got[t].item() - want.item()) < 1e-4, t


def make_data(d, vocab=48, n_train=30000, n_val=3000):
    """A learnable toy corpus: documents of a noisy counting pattern, ended by eos (id 2)."""
    rng = np.random.default_rng(0)

    def stream(n):
        out = []
        while len(out) < n:
            start, step = rng.integers(3, vocab), rng.integers(1, 4)
            doc = (start + step * np.arange(rng.integers(20, 200))) % (vocab - 3) + 3
            noise = rng.random(doc.size) < 0.1
            doc[noise] = rng.integers(3, vocab, noise.sum())
            out.extend(doc.tolist() + [2])
        return np.array(out[:n], dtype=np.uint16)

    os.makedirs(d, exist_ok=True)
    stream(n_train).tofile(os.path.join(d, "train.bin"))
    stream(n_val).tofile(os.path.join(d, "val.bin"))
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"name": "toy", "vocab_size": vocab, "dtype": "uint16", "eos_id": 2,
                   "bos_id": 1, "train_tokens": n_train, "val_tokens": n_val}, f)


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_ablation_smoke(tmp_path, capsys, monkeypatch):
    # its 11 train.py subprocesses, one thread each (tiny models: see tests/conftest.py)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    make_data(data)
    argv = [f"--data_dir={data}", f"--out={out}", "--max_iters=4", "--eval_interval=2",
            "--eval_iters=1", "--batch_size=4", "--block_size=16", "--n_layer=1", "--n_head=2",
            "--n_embd=16", "--seeds=3,4", "--eval_windows=2", "--eval_batch=2", "--gen_seqs=2",
            "--gen_mult=3", "--gen_stride=2", "--sinks=2", "--variants=" + ",".join(ablation.VARIANTS),
            "--log_interval=2"]  # the last one goes to train.py
    ablation.main(argv)
    runs = {(v, s) for v in ablation.VARIANTS for s in ([3, 4] if v in ("rope", "learned") else [3])}

    curves = read_csv(os.path.join(out, "curves.csv"))
    assert {(r["variant"], int(r["seed"])) for r in curves} == runs
    for v, s in runs:
        its = [int(r["iter"]) for r in curves if (r["variant"], int(r["seed"])) == (v, s)]
        assert its == [0, 2, 4]
    assert all(math.isfinite(float(r["val_loss"])) for r in curves)

    extrap = read_csv(os.path.join(out, "extrapolation.csv"))
    by = {(r["variant"], int(r["seed"]), r["method"]): r for r in extrap}
    assert {(v, s) for v, s, _ in by} == runs
    for (v, s, method), r in by.items():
        for col in ("1x", "2x", "4x"):
            if v == "learned" and col != "1x":
                assert r[col] == ""  # n/a: learned positions end at block_size
            else:
                assert math.isfinite(float(r[col])), (v, method, col)
        # at 1x every method computes the plain forward (rope_factor 1, window = block)
        assert abs(float(r["1x"]) - float(by[(v, s, "full")]["1x"])) < 1e-4
    assert {m for v, s, m in by if v == "rope"} == {"full", "pi", "ntk", "window"}
    assert {m for v, s, m in by if v == "learned"} == {"full"}
    assert {m for v, s, m in by if v.startswith("linear")} == {"full"}
    for v in ("shaw", "t5", "alibi"):
        assert {m for vv, s, m in by if vv == v} == {"full", "window"}

    gen = read_csv(os.path.join(out, "generation.csv"))
    methods = {(r["variant"], r["method"]) for r in gen}
    for v in ("rope", "sinusoidal", "none", "shaw", "t5", "alibi"):
        assert {m for vv, m in methods if vv == v} == {"crop", "full", "rolling", "sinks"}
    assert {m for vv, m in methods if vv == "learned"} == {"crop"}
    for v in ("linear_rope", "linear_none"):
        assert {m for vv, m in methods if vv == v} == {"crop", "recurrent"}
    assert all(math.isfinite(float(x)) for r in gen for k, x in r.items()
               if k not in ("variant", "seed", "method"))

    summary = open(os.path.join(out, "summary.md")).read()
    for v in ablation.VARIANTS:
        assert f"| {v} |" in summary
    assert "rope − learned, per seed" in summary

    # a second call reuses the finished runs instead of training again
    mtimes = {p: os.path.getmtime(os.path.join(out, "runs", p, "ckpt.pt"))
              for p in os.listdir(os.path.join(out, "runs"))}
    capsys.readouterr()
    ablation.main(argv + ["--stages=train"])
    assert capsys.readouterr().out.count("reused") == len(runs)
    assert all(os.path.getmtime(os.path.join(out, "runs", p, "ckpt.pt")) == t
               for p, t in mtimes.items())


def test_bad_arguments_exit_with_one_line():
    for argv, word in [(["--variants=rope,xpos"], "xpos"), (["--seeds=1,x"], "seeds"),
                       (["--stages=train,plot"], "plot"), (["positional"], "positional"),
                       (["--max_iters=10", "--eval_interval=20"], "eval_interval"),
                       (["--stages=extrap", "--dtype=float32"], "dtype")]:
        with pytest.raises(SystemExit) as e:
            ablation.parse_args(argv)
        assert word in str(e.value) and str(e.value).startswith("error:")
