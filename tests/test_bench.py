"""bench/train_speed.py --target (time to nanoGPT's final loss): a tiny run, its table checked
against the per-chunk log it prints, and reproducible from its seed."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def target_run(text):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "train_speed.py"), "--target=True",
           f"--text={text}", "--target_iters=8", "--target_eval=2", "--target_batches=2",
           "--threads=1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, r.stderr


def test_time_to_target_table_matches_its_log(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("".join(f"line {i}: the quick brown fox, {i * i % 97}.\n" for i in range(400)))
    out, err = target_run(text)
    # per chunk: "iter N: loss (s), loss (s), loss (s)" for nanoGPT, ours Muon, ours AdamW
    log = [(int(m[1]), [(float(a), float(b)) for a, b in re.findall(r"([\d.]+) \(([\d.]+) s\)",
                                                                    m[2])])
           for m in re.finditer(r"^iter (\d+): (.*)$", err, re.M)]
    assert [it for it, _ in log] == [2, 4, 6, 8]
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ours")
            or line.startswith("| nanoGPT")]
    assert [r[0].strip() for r in rows] == ["nanoGPT, AdamW", "ours, Muon", "ours, AdamW"]
    goal = log[-1][1][0][0]
    for k, row in enumerate(rows):
        assert float(row[1]) == log[-1][1][k][0]  # final loss
        assert abs(float(row[2]) - (log[-1][1][k][0] - goal)) < 2e-4
        hit = next(((it, losses) for it, losses in log if losses[k][0] <= goal), None)
        if hit is None:
            assert row[3].strip() == "-"
            continue
        it, losses = hit
        ours, base = losses[k][1], losses[0][1]  # seconds, to 0.01 in the log
        assert int(row[3]) == it
        assert abs(float(row[4]) - ours) <= 0.06 and abs(float(row[5]) - base) <= 0.06
        ratio = ours / base * it / 8  # the same iterations' time ratio, scaled to the whole run
        assert abs(float(row[6].strip(" x")) - ratio) <= 0.006 + ratio * (0.006 / ours +
                                                                          0.006 / base)
    assert rows[0][3].strip() != "-"  # nanoGPT reaches its own final loss
    again = target_run(text)[1]  # seeded: the same losses at every chunk
    assert re.sub(r"\(.*? s\)", "", again) == re.sub(r"\(.*? s\)", "", err)


def test_missing_text_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "train_speed.py"), "--target=True",
                        f"--text={tmp_path / 'nope.txt'}"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert "--text=PATH" in r.stderr


def test_target_runs_every_group_at_its_own_peak_rate(monkeypatch):
    """--target's Muon run once set every group's rate from a key the optimizer no longer had,
    so Muon's matrices trained at AdamW's 1e-3 instead of muon_lr. Reference: the schedule's
    fraction times each group's base_lr, which build_optimizer sets (muon_lr for Muon's
    groups, the recipe's rate for the rest)."""
    import numpy as np
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import nanogpt_recipe as recipe  # --target's runs (train_speed.py passes them its options)
    args = {"seed": 1337, "muon_lr": 0.05, "target_iters": 2000}
    run = recipe.TargetRun("ours, Muon", 65, args)
    run.train(np.random.default_rng(0).integers(0, 65, 1000).astype(np.int64), 3)
    frac = recipe.recipe_lr(2, args["target_iters"]) / recipe.LR
    rates = sorted({(g["base_lr"], g["lr"]) for g in run.opt.param_groups})
    assert [b for b, _ in rates] == [recipe.LR, 0.05]
    for base, lr in rates:
        assert abs(lr - frac * base) < 1e-12
