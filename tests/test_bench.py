"""bench/speed/train_speed.py --target (time to nanoGPT's final loss): a tiny run, its table checked
against the per-chunk log it prints, and reproducible from its seed; bench/speed/gpu_speed.py's table
and the MFU formula, checked on the CPU."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def target_run(text, *extra):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "speed", "train_speed.py"), "--target=True",
           f"--text={text}", "--target_iters=8", "--target_eval=2", "--target_batches=2",
           "--threads=1", *extra]
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


def test_ours_stop_at_the_end_of_their_own_schedule(tmp_path):
    """With --ours_iters=4 of nanoGPT's 8, our two runs train 4 iterations and then stand still
    (their loss and seconds unchanged in every later chunk of the log) while nanoGPT trains on;
    the table's total for ours is their time at iteration 4. Reference: the per-chunk log."""
    text = tmp_path / "t.txt"
    text.write_text("".join(f"line {i}: the quick brown fox, {i * i % 97}.\n" for i in range(400)))
    out, err = target_run(text, "--ours_iters=4", "--ours_warmup=1", "--ours_cooldown=0.5")
    log = [[(float(a), float(b)) for a, b in re.findall(r"([\d.]+) \(([\d.]+) s\)", line)]
           for line in err.splitlines() if line.startswith("iter ")]
    assert len(log) == 4 and "ours on its own schedule: 4 iterations" in out
    for k in (1, 2):  # ours, Muon and ours, AdamW
        assert log[1][k] == log[2][k] == log[3][k] and log[0][k] != log[1][k]
        row = [r for r in out.splitlines() if r.startswith("| ours")][k - 1].split("|")
        assert abs(float(row[-2]) - log[1][k][1]) <= 0.06
    assert log[3][0][1] > log[2][0][1] > log[1][0][1]  # nanoGPT trains on


def test_missing_text_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "speed", "train_speed.py"),
                        "--target=True", f"--text={tmp_path / 'nope.txt'}"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert "--text=PATH" in r.stderr


def test_target_runs_every_group_at_its_own_peak_rate(monkeypatch):
    """--target's Muon run once set every group's rate from a key the optimizer no longer had,
    so Muon's matrices trained at AdamW's 1e-3 instead of muon_lr. Reference: the schedule's
    fraction times each group's base_lr, which build_optimizer sets (muon_lr for Muon's
    groups, the recipe's rate for the rest)."""
    import numpy as np
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench", "speed"))
    import nanogpt_recipe as recipe  # --target's runs (train_speed.py passes them its options)
    args = {"seed": 1337, "muon_lr": 0.05, "target_iters": 2000}
    run = recipe.TargetRun("ours, Muon", 65, args)
    run.train(np.random.default_rng(0).integers(0, 65, 1000).astype(np.int64), 3)
    frac = recipe.recipe_lr(2, args["target_iters"]) / recipe.LR
    rates = sorted({(g["base_lr"], g["lr"]) for g in run.opt.param_groups})
    assert [b for b, _ in rates] == [recipe.LR, 0.05]
    for base, lr in rates:
        assert abs(lr - frac * base) < 1e-12


def test_ours_own_schedule_is_the_trapezoid_written_out(monkeypatch):
    """--ours_iters/--ours_warmup/--ours_cooldown/--ours_lr give ours a schedule and an AdamW
    rate of their own while nanoGPT keeps its recipe (1e-3). Reference: the rates of a
    10-iteration run (warmup 2, cooldown 0.5) as fractions of the peak, worked out by hand:
    (it + 1) / 3 during warmup, the peak while the decay is in its first half, then linear
    from the peak to lr/10 (0.775, 0.55, 0.325 of the peak)."""
    import numpy as np
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench", "speed"))
    import nanogpt_recipe as recipe
    args = {"seed": 1337, "muon_lr": 0.05, "target_iters": 2000, "ours_iters": 10,
            "ours_warmup": 2, "ours_cooldown": 0.5, "ours_lr": 3e-3}
    ours = recipe.TargetRun("ours, AdamW", 65, args)
    base = recipe.TargetRun("nanoGPT, AdamW", 65, args)
    data = np.random.default_rng(0).integers(0, 65, 1000).astype(np.int64)
    seen = {"ours": [], "base": []}
    for _ in range(10):
        for name, run in (("ours", ours), ("base", base)):
            run.train(data, 1)
            seen[name].append(run.opt.param_groups[0]["lr"] / (3e-3 if name == "ours" else 1e-3))
    want = [1 / 3, 2 / 3, 1, 1, 1, 1, 1, 0.775, 0.55, 0.325]
    assert max(abs(a - b) for a, b in zip(seen["ours"], want)) < 1e-12
    assert max(abs(a - (it + 1) / 101) for it, a in enumerate(seen["base"])) < 1e-12


def test_ours_qk_norm_builds_our_runs_only(monkeypatch):
    """--ours_qk_norm=True: both of our runs build the model with qk_norm (model.py's option,
    checked against the float64 reference in tests/test_model.py), nanoGPT's keeps its recipe,
    and the table's heading names it."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench", "speed"))
    import nanogpt_recipe as recipe
    args = {"seed": 1337, "muon_lr": 0.05, "target_iters": 2000, "ours_qk_norm": True}
    kinds = ("nanoGPT, AdamW", "ours, Muon", "ours, AdamW")
    assert [recipe.TargetRun(k, 65, args).model.config.qk_norm for k in kinds] == [False, True, True]
    assert "qk_norm" in recipe.ours_schedule(args)
    assert "qk_norm" not in recipe.ours_schedule(dict(args, ours_qk_norm=False))


def test_ours_short_trains_our_first_iterations_on_shorter_windows(monkeypatch, tmp_path):
    """--ours_short=N --ours_short_block=L: our two runs' first N iterations see L-token windows
    of the training ids (inputs, and targets one token on), as many as the batch, then the full
    block; nanoGPT's run always sees the full block. Reference: the shapes the model was given
    and each window found in the data. A block outside 1..64 is one line."""
    import numpy as np
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench", "speed"))
    import nanogpt_recipe as recipe
    args = {"seed": 1337, "muon_lr": 0.05, "target_iters": 2000, "ours_short": 3,
            "ours_short_block": 16}
    data = np.random.default_rng(0).integers(0, 65, 5000).astype(np.int64)
    for kind, want in (("nanoGPT, AdamW", [64] * 5), ("ours, Muon", [16] * 3 + [64] * 2),
                       ("ours, AdamW", [16] * 3 + [64] * 2)):
        run, seen = recipe.TargetRun(kind, 65, args), []
        run.model.forward = lambda x, y, f=run.model.forward: seen.append((x, y)) or f(x, y)
        run.train(data, 5)
        assert [x.shape for x, _ in seen] == [(12, T) for T in want], kind
        for x, y in seen:
            for a, b in zip(x.numpy(), y.numpy()):
                s = next(i for i in range(len(data)) if np.array_equal(data[i:i + len(a)], a))
                assert np.array_equal(data[s + 1:s + 1 + len(b)], b)
    assert "the first 3 iterations on 16-token windows" in recipe.ours_schedule(args)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "speed", "train_speed.py"),
                        "--target=True", "--ours_short=5", "--ours_short_block=65",
                        f"--text={tmp_path}"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: --ours_short") and "65" in r.stderr


def test_ours_dtype_autocasts_our_runs_only(monkeypatch, tmp_path):
    """--ours_dtype=bfloat16 (what auto picks on a CPU with native bf16, as train.py does): our
    two runs train and are scored under bf16 autocast, nanoGPT's stays float32, and the heading
    names the dtype. Reference: the logits' dtype inside each run's context, and the score
    recomputed by hand under torch.autocast. A dtype train.py refuses on a CPU is one line."""
    import torch
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench", "speed"))
    import nanogpt_recipe as recipe
    args = {"seed": 1337, "muon_lr": 0.05, "target_iters": 2000, "ours_dtype": "bfloat16"}
    x = torch.randint(0, 65, (2, 8))
    for kind, want in (("nanoGPT, AdamW", torch.float32), ("ours, Muon", torch.bfloat16),
                       ("ours, AdamW", torch.bfloat16)):
        run = recipe.TargetRun(kind, 65, args)
        with torch.no_grad(), run.autocast():
            assert run.model(x)[0].dtype == want
        run.score([(x, x)])
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=want != torch.float32):
            assert run.curve[-1][2] == run.model.eval()(x, x)[1].item()
    assert "bf16 autocast" in recipe.ours_schedule(args)
    assert "float32" in recipe.ours_schedule(dict(args, ours_dtype="float32"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "speed", "train_speed.py"),
                        "--target=True", "--ours_dtype=float16", f"--text={tmp_path}"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: --ours_dtype: ") and "float16" in r.stderr


def test_train_dtype_reaches_train_py():
    """--train_dtype is train.py's --dtype in --whole (and --overhead): float16, which train.py
    refuses on a CPU in one line, comes back as that line, so the value went through."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "speed", "train_speed.py"),
                        "--whole=True", "--iters=2", "--eval_iters=1", "--rounds=1",
                        "--threads=1", "--train_dtype=float16"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.startswith("error: train.py failed: ")
    assert "dtype=float16 needs CUDA" in r.stderr


def load_gpu_speed(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench", "speed"))
    import gpu_speed
    return gpu_speed


def test_gpu_speed_table_is_its_own_arithmetic(monkeypatch, capsys):
    """bench/speed/gpu_speed.py (run on a GPU by cuda_check.sh) on the CPU with a tiny model: every
    figure of its table follows from what it timed. Reference: the definitions, tokens over
    seconds, MFU = FLOPs per token x tokens/s / peak, decode tokens/s = batch x new tokens
    over the call's seconds; and transformers' greedy decode on the same weights draws our
    tokens (the two columns time the same model)."""
    import json
    gpu_speed = load_gpu_speed(monkeypatch)
    gpu_speed.main(["--device=cpu", "--tiny", "--no-compile", "--steps=3", "--warmup=1",
                    "--new_tokens=6", "--batches=1,3", "--peak=2e12", "--json"])
    out = capsys.readouterr().out.splitlines()
    fig = json.loads(out[-1])
    train, decode = fig["train"], fig["decode"]
    assert train["tokens"] == 3 * train["batch"] * train["block"]
    assert abs(train["tokens_per_s"] - train["tokens"] / train["seconds"]) < 1e-6
    assert abs(train["step_ms"] - 1e3 * train["seconds"] / 3) < 1e-9
    want = train["flops_per_token"] * train["tokens_per_s"] / 2e12
    assert abs(train["mfu"] - want) < 1e-12
    rows = dict([cell.strip() for cell in line.strip("|").split("|")] for line in out
                if line.startswith("| ") and "measure" not in line)
    assert rows["train tokens/s"] == f"{train['tokens_per_s']:,.0f}"
    assert rows["MFU"] == f"{100 * want:.1f}% of 2 TFLOP/s"
    assert [r["batch"] for r in decode] == [1, 3]
    for r in decode:
        assert abs(r["tokens_per_s"] - r["batch"] * 6 / r["seconds"]) < 1e-6
        assert abs(r["hf_tokens_per_s"] - r["batch"] * 6 / r["hf_seconds"]) < 1e-6
        assert r["hf_same_tokens"] == 1.0
        cell = rows[f"decode batch {r['batch']} tokens/s: ours, transformers"]
        assert cell.startswith(f"{r['tokens_per_s']:,.1f}, {r['hf_tokens_per_s']:,.1f} (ours "
                               f"{r['tokens_per_s'] / r['hf_tokens_per_s']:.2f}x")


@pytest.mark.parametrize("shape", [dict(n_layer=2, n_head=4, n_embd=128, block_size=128),
                                   dict(n_layer=3, n_head=2, n_embd=64, block_size=256)])
def test_mfu_counts_the_flops_torch_counts(shape):
    """harness/mfu.flops_per_token (train.py's MFU and gpu_speed's) against a count of every
    matrix product one training step runs: torch's FlopCounterMode over a forward and
    backward, attention by its math kernel so that its products are counted too."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    sys.path.insert(0, ROOT)
    from harness.mfu import flops_per_token
    from model import RoFormer, RoFormerConfig
    cfg = RoFormerConfig(vocab_size=512, **shape)
    model, B, T = RoFormer(cfg, seed=0), 2, shape["block_size"]
    x, y = torch.randint(0, 512, (2, B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counted:
        model(x, y)[1].backward()
    ours = flops_per_token(cfg, model.num_params(), T) * B * T
    # ours also counts the norms' and biases' parameters, which run no matrix product
    assert abs(ours / counted.get_total_flops() - 1) < 0.005, (ours, counted.get_total_flops())


def test_ns_coefficients_derive_the_logged_patches_and_say_where_they_leave_the_spectrum():
    """bench/studies/ns_coefficients.py: its derivation gives the (a, b, c) written in
    bench/patches/ns_per_step4.patch and ns_per_step5.patch (docs/LOG.md's entry), and the
    singular-value ranges it prints are those of the matrix iteration itself (float64 SVD of
    Newton-Schulz, written out here, on a matrix whose singular values fill [low, 1])."""
    pytest.importorskip("scipy", reason="bench/studies/ns_coefficients.py solves its minimax with scipy")
    import importlib.util
    import numpy as np
    import torch
    spec = importlib.util.spec_from_file_location(
        "ns_coefficients", os.path.join(ROOT, "bench", "studies", "ns_coefficients.py"))
    ns = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ns)
    torch.manual_seed(0)
    for patch, steps, low in (("ns_per_step4.patch", 4, 0.003), ("ns_per_step5.patch", 5, 0.001)):
        with open(os.path.join(ROOT, "bench", "patches", patch)) as f:
            added = f.read().split("+    COEFFICIENTS = (")[1].split("))")[0]
        written = [float(v) for v in re.findall(r"-?\d+\.\d+", added)]
        derived = ns.derive(steps, low)
        assert len(written) == 3 * steps
        assert np.abs(np.array(derived).ravel() - written).max() < 2e-4, (patch, derived)
        # the printed range, against the iteration on a matrix (48 x 144, turned as Muon turns)
        s = torch.logspace(np.log10(low), 0, 48, dtype=torch.float64)
        u, _ = torch.linalg.qr(torch.randn(48, 48, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(144, 48, dtype=torch.float64))
        x = u @ torch.diag(s) @ v.T
        for a, b, c in derived:
            g = x @ x.T
            x = a * x + (b * g + c * g @ g) @ x
        got = torch.linalg.svdvals(x)
        lo, hi = ns.singular_range(derived, low)
        assert abs(got.min().item() - lo) < 0.02 and abs(got.max().item() - hi) < 0.02, (lo, hi)
    # what the entry says: 4 steps of their own from [0.003, 1] end nearer 1 than torch's 5
    lo4, hi4 = ns.singular_range(ns.derive(4, 0.003), 0.003)
    lo5, hi5 = ns.singular_range([ns.TORCH] * 5, 0.003)
    assert 0.80 <= lo4 and hi4 <= 1.21 and lo5 < 0.69 and hi5 > 1.19, (lo4, hi4, lo5, hi5)
