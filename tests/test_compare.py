"""bench/compare.py: its t distribution against numeric integration of the t density, and one
tiny end-to-end compare in a scratch git repository (a copy of this tree, committed, then
edited): --against=HEAD with a dirty working tree, 2 arms x 2 seeds with the real train.py and
eval.py, results.json checked against the runs' own logs and scores, a patch that does not
apply reported in one line while the others finish, and a second invocation that trains
nothing."""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("compare", os.path.join(ROOT, "bench", "compare.py"))
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def t_density(x, df):
    return math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi) \
        * (1 + x * x / df) ** (-(df + 1) / 2)


def integral(f, a, b, n=20000):
    """Simpson's rule with n (even) intervals."""
    xs = np.linspace(a, b, n + 1)
    ys = np.array([f(x) for x in xs])
    return (b - a) / n / 3 * (ys[0] + ys[-1] + 4 * ys[1:-1:2].sum() + 2 * ys[2:-1:2].sum())


@pytest.mark.parametrize("df", [1, 2, 3, 5, 30])
def test_t_distribution_matches_the_integrated_density(df):
    for t in (-7.0, -2.5, -0.3, 0.0, 0.8, 4.3):
        want = 0.5 + math.copysign(integral(lambda x: t_density(x, df), 0, abs(t)), t)
        assert abs(compare.t_cdf(t, df) - want) < 1e-7, (t, df)
    q = compare.t_quantile(0.975, df)
    assert abs(integral(lambda x: t_density(x, df), 0, q) - 0.475) < 1e-7


def test_paired_test_is_the_t_test_of_the_differences():
    diffs = [0.031, 0.012, 0.024, -0.004]
    r = compare.paired(diffs)
    n, mean = len(diffs), sum(diffs) / len(diffs)
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) / math.sqrt(n)
    tail = integral(lambda x: t_density(x, n - 1), 0, mean / se)
    assert abs(r["p"] - (1 - 2 * tail)) < 1e-7
    half = r["ci95"][1] - mean
    assert abs(integral(lambda x: t_density(x, n - 1), 0, half / se) - 0.475) < 1e-7
    assert abs(mean - r["ci95"][0] - half) < 1e-12
    assert compare.paired([0.1])["ci95"] is None  # one pair: no interval


def scratch_repo(root):
    """A git repository holding this tree's files (tracked and untracked, not ignored),
    committed; returns its path."""
    repo = os.path.join(root, "repo")
    files = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "-co", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in (f for f in files if f and os.path.isfile(os.path.join(ROOT, f))):
        os.makedirs(os.path.dirname(os.path.join(repo, f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(repo, f))
    git = ["git", "-C", repo, "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", repo], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "scratch"], check=True)
    return repo


@pytest.mark.slow
def test_compare_against_head_with_a_dirty_tree(tmp_path):
    from test_eval import corpus_docs  # a tokenized corpus (eval.py --split needs its tokenizer)
    repo = scratch_repo(str(tmp_path))
    with open(os.path.join(repo, "model.py"), "a") as f:
        f.write("# an uncommitted edit\n")  # a change of the code that computes the same
    patch = tmp_path / "bad.patch"
    patch.write_text("--- a/no_such_file.py\n+++ b/no_such_file.py\n@@ -1 +1 @@\n-a\n+b\n")
    data = os.path.join(str(tmp_path), "data")
    from data import common
    common.prepare(data, "tiny", [("docs", "docs", lambda: [t for _, t in corpus_docs()])],
                   "test", vocab_size=400, val_fraction=0.2, min_val_tokens=200, num_proc=1,
                   log=lambda *a: None)
    out = os.path.join(str(tmp_path), "out")
    cmd = [sys.executable, os.path.join(repo, "bench", "compare.py"), "--against=HEAD",
           f"--variant=patch:{patch}", "--seeds=2", "--max_iters=4", "--eval_interval=2",
           "--eval_iters=1", "--eval_tokens=300", f"--data_dir={data}", "--dataset=tiny",
           f"--out={out}", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=32",
           "--batch_size=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    broken = [ln for ln in (r.stdout + r.stderr).splitlines() if "bad.patch" in ln
              and ln.startswith("error:")]
    assert len(broken) == 1 and "does not apply" in broken[0], r.stdout + r.stderr
    records = {rec["arm"]: rec for rec in json.load(open(os.path.join(out, "results.json")))}
    assert list(records) == ["base (HEAD)", "worktree", f"patch:{patch}"]
    assert records[f"patch:{patch}"]["broken"] and not records[f"patch:{patch}"]["runs"]
    # each code version materialised once, HEAD's without the edit, the tree's with it
    base_code = os.path.join(out, records["base (HEAD)"]["code"])
    tree_code = os.path.join(out, records["worktree"]["code"])
    assert "uncommitted edit" not in open(os.path.join(base_code, "model.py")).read()
    assert "uncommitted edit" in open(os.path.join(tree_code, "model.py")).read()
    assert subprocess.run(["git", "-C", repo, "status", "--porcelain"], capture_output=True,
                          text=True).stdout.strip() == "M model.py"  # the checkout untouched
    for name in ("base (HEAD)", "worktree"):
        rec = records[name]
        assert rec["seeds"] == [1337, 1338]
        for k, run in enumerate(rec["runs"]):
            rdir = os.path.join(out, "runs", f"arm{list(records).index(name)}_s{run['seed']}")
            log = [json.loads(ln) for ln in open(os.path.join(rdir, "log.jsonl"))]
            score = [json.loads(ln) for ln in open(os.path.join(rdir, "eval.out"))
                     if ln.startswith("{")][-1]
            assert run["tokens"] == log[-1]["tokens"] == 4 * 2 * 32  # equal tokens everywhere
            assert run["loss"] == score["nats_per_token"] and run["bpb"] == score["bits_per_byte"]
            assert score["tokens"] == 300  # the same held-out slice for every run
            assert abs(run["tokens_per_s"] - log[-1]["tokens"] / log[-1]["time_s"]) < 1e-9
        assert abs(rec["loss_mean"] - np.mean([x["loss"] for x in rec["runs"]])) < 1e-12
        assert abs(rec["loss_std"] - np.std([x["loss"] for x in rec["runs"]], ddof=1)) < 1e-12
    # the same computation in both code versions, the same seeds: identical scores
    diff = records["worktree"]["loss_diff"]
    assert diff["pairs"] == 2 and diff["mean"] == 0.0 and diff["ci95"] == [0.0, 0.0]
    assert os.path.exists(os.path.join(out, "results.md"))
    assert os.path.exists(os.path.join(out, "compare.png"))

    ckpts = {d: os.path.getmtime(os.path.join(out, "runs", d, "ckpt.pt"))
             for d in os.listdir(os.path.join(out, "runs"))
             if os.path.exists(os.path.join(out, "runs", d, "ckpt.pt"))}
    assert len(ckpts) == 4
    r2 = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert (r2.stdout + r2.stderr).count("finished run reused") == 4
    assert all(os.path.getmtime(os.path.join(out, "runs", d, "ckpt.pt")) == t
               for d, t in ckpts.items())
    again = {rec["arm"]: rec for rec in json.load(open(os.path.join(out, "results.json")))}
    assert again["worktree"]["runs"] == records["worktree"]["runs"]


def test_bad_arguments_are_one_line():
    for argv, word in [(["--seeds=0"], "seeds"), (["--x"], "--x"), (["--eval_tokens=1"], "eval_tokens"),
                       (["no_such_config.py"], "config file")]:
        with pytest.raises(SystemExit) as e:
            compare.main(argv)
        assert str(e.value).startswith("error:") and word in str(e.value), e.value


def test_the_base_again_is_its_own_arm_with_other_seeds(tmp_path):
    args = compare.parse_args(["--variant=base", "--variant=n_layer=2 dropout=0.1", "--seeds=2",
                               f"--out={tmp_path}"])
    arms = compare.plan_arms(args)
    runs = compare.plan_runs(args, arms)
    assert [a["name"] for a in arms] == ["base", "base, other seeds", "n_layer=2 dropout=0.1"]
    assert arms[2]["keys"] == {"n_layer": "2", "dropout": "0.1"}
    seeds = {a["name"]: [r["seed"] for r in runs if r["arm"] is a] for a in arms}
    assert seeds["base"] == seeds["n_layer=2 dropout=0.1"]  # paired: the same batches
    assert not set(seeds["base"]) & set(seeds["base, other seeds"])
    # seed-major: every arm's first seed before any arm's second
    assert [r["pair"] for r in runs] == [0, 0, 0, 1, 1, 1]


@pytest.mark.skipif(shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git"))
                    and not os.path.isfile(os.path.join(ROOT, ".git")), reason="needs a git checkout")
@pytest.mark.parametrize("patch", sorted(os.listdir(os.path.join(ROOT, "bench", "patches"))))
def test_the_logged_patches_still_apply_to_this_tree(patch, tmp_path):
    """docs/LOG.md's changes are reruns of bench/patches/*.patch: each must apply to today's
    model.py (a copy of it, in a scratch repository), and the patched model must still build
    and run a forward, so that `--variant=patch:...` reruns the entry instead of failing."""
    shutil.copy(os.path.join(ROOT, "model.py"), tmp_path / "model.py")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    r = subprocess.run(["git", "apply", os.path.join(ROOT, "bench", "patches", patch)],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, f"{patch} no longer applies to model.py: {r.stderr.strip()}"
    code = ("import sys, torch; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import model; "
            "c = model.RoFormerConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32); "
            "m = model.RoFormer(c); x = torch.randint(0, 64, (1, 16)); "
            "print(m(x, x)[1].item())")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), ROOT], capture_output=True,
                       text=True)
    assert r.returncode == 0 and math.isfinite(float(r.stdout)), r.stderr[-500:]
