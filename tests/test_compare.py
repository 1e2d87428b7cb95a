"""bench/compare.py: its t distribution against numeric integration of the t density, and one
tiny end-to-end compare in a scratch git repository (a copy of this tree, committed, then
edited): --against=HEAD with a dirty working tree, 2 arms x 2 seeds with the real train.py and
eval.py, results.json checked against the runs' own logs and scores, a patch that does not
apply reported in one line while the others finish, and a second invocation that trains
nothing. Then fast unit tests (train.py and eval.py stubbed) that the lab reports only what it
measured: runs keyed by everything that decides them, folders named by the arm, compare's own
settings refused as flags and variant keys, no p = 0 from identical differences, progress while
a run trains, one thread count for every run."""
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("compare", os.path.join(ROOT, "bench", "compare.py"))
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)
import compare_report  # noqa: E402  (compare.py put bench/lab/ on sys.path; so for stats)
import stats  # noqa: E402


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
        assert abs(stats.t_cdf(t, df) - want) < 1e-7, (t, df)
    q = stats.t_quantile(0.975, df)
    assert abs(integral(lambda x: t_density(x, df), 0, q) - 0.475) < 1e-7


def test_paired_test_is_the_t_test_of_the_differences():
    diffs = [0.031, 0.012, 0.024, -0.004]
    r = stats.paired(diffs)
    n, mean = len(diffs), sum(diffs) / len(diffs)
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) / math.sqrt(n)
    tail = integral(lambda x: t_density(x, n - 1), 0, mean / se)
    assert abs(r["p"] - (1 - 2 * tail)) < 1e-7
    half = r["ci95"][1] - mean
    assert abs(integral(lambda x: t_density(x, n - 1), 0, half / se) - 0.475) < 1e-7
    assert abs(mean - r["ci95"][0] - half) < 1e-12
    assert stats.paired([0.1])["ci95"] is None  # one pair: no interval


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
    from data import pipeline
    pipeline.prepare(data, "tiny", [("docs", "docs", lambda: [t for _, t in corpus_docs()])],
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
            rdir = os.path.join(out, rec["runs_dir"].replace("SEED", str(run["seed"])))
            assert run["threads"] == "1"  # the user's OMP_NUM_THREADS, for every run
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
    files (copies of those it touches, model.py, muon.py or train.py, in a scratch repository),
    the patched model must still build, run a forward and take a Muon step, and a patched
    train.py must compile, so that `--variant=patch:...` reruns the entry instead of failing."""
    path = os.path.join(ROOT, "bench", "patches", patch)
    with open(path) as f:
        touched = re.findall(r"^\+\+\+ b/(\S+)$", f.read(), flags=re.M)
    assert touched and set(touched) <= {"model.py", "muon.py", "train.py"}, touched
    for name in touched:
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    r = subprocess.run(["git", "apply", path], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, f"{patch} no longer applies to {touched}: {r.stderr.strip()}"
    if "train.py" in touched:
        r = subprocess.run([sys.executable, "-m", "py_compile", str(tmp_path / "train.py")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-500:]
    code = ("import sys, torch; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import model, muon; "
            "c = model.RoFormerConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32); "
            "m = model.RoFormer(c); x = torch.randint(0, 64, (1, 16)); loss = m(x, x)[1]; "
            "loss.backward(); muon.Muon([p for p in m.parameters() if p.dim() == 2], lr=0.01, "
            "ns_dtype=torch.float32).step(); print(loss.item())")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), ROOT], capture_output=True,
                       text=True)
    assert r.returncode == 0 and math.isfinite(float(r.stdout)), r.stderr[-500:]


def test_a_patch_arm_is_patched_when_out_lies_inside_a_checkout(tmp_path):
    """compare's default --out (bench/results/compare) lies inside the repository: git apply
    run in a code copy there took the patch's paths from the checkout's root, skipped them all
    and exited 0, so a patch arm trained the base's code (found in issue 46's lab). Reference:
    the file reads as the patch writes it, in a copy under a git repository's folder; a patch
    that changes nothing is refused, not run as an arm."""
    import lab_runs
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    base = tmp_path / "out" / "code" / "tree-base"
    base.mkdir(parents=True)
    (base / "model.py").write_text("x = 1\n")
    head = "diff --git a/model.py b/model.py\n--- a/model.py\n+++ b/model.py\n@@ -1 +1 @@\n"
    patch = tmp_path / "two.patch"
    patch.write_text(head + "-x = 1\n+x = 2\n")
    code = lab_runs.patched_code(str(tmp_path / "out"), str(base), str(patch))
    assert open(os.path.join(code, "model.py")).read() == "x = 2\n"
    assert (base / "model.py").read_text() == "x = 1\n"
    same = tmp_path / "same.patch"
    same.write_text(head + "-x = 1\n+x = 1\n")
    with pytest.raises(compare.UserError, match="same.patch does not apply: git apply changed no"):
        lab_runs.patched_code(str(tmp_path / "out"), str(base), str(same))
    left = sorted(os.listdir(tmp_path / "out" / "code"))  # nothing of the refused arm
    assert left == sorted(["tree-base", os.path.basename(code)])


# ----------------------------------------------------------------------------------------
# the lab reports only what it measured (issue 45): keys, names, refusals, progress

def fake_args(tmp_path, *argv):
    """compare's parsed arguments for a scratch --out, with a config file of its own."""
    config = tmp_path / "cfg.py"
    if not config.exists():
        config.write_text("n_layer = 1\n")
    return compare.parse_args([str(config), f"--out={tmp_path / 'out'}", "--max_iters=4", *argv])


def fake_arms(tmp_path, args, code="tree-aaaa"):
    """plan_arms with the working tree's copy stubbed by a folder named like one, holding one
    file that says which (no tree is copied)."""
    folder = tmp_path / "out" / "code" / code
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(f"# the code {code}\n")  # the identity hashes the files
    real = compare.worktree_code
    compare.worktree_code = lambda out: str(folder)
    try:
        return compare.plan_arms(args)
    finally:
        compare.worktree_code = real


class FakeTrainer:
    """compare.run_logged for train.py and eval.py without running them: writes what they would
    (a checkpoint, log.jsonl at max_iters, eval.py's JSON line) and counts the trainings."""
    def __init__(self):
        self.trained = 0

    def __call__(self, cmd, cwd, out_path, on_line=None, env=None):
        self.threads = getattr(self, "threads", []) + [(env or {}).get("OMP_NUM_THREADS")]
        flags = dict(a[2:].split("=", 1) for a in cmd[2:] if a.startswith("--"))
        if cmd[1].endswith("train.py"):
            self.trained += 1
            n = int(flags["max_iters"])
            with open(os.path.join(flags["out_dir"], "ckpt.pt"), "w") as f:
                f.write("x")
            with open(os.path.join(flags["out_dir"], "log.jsonl"), "w") as f:
                f.write(json.dumps({"iter": n, "tokens": 64 * n, "time_s": 1.0, "val_loss": 3.0})
                        + "\n")
            open(out_path, "w").write(f"iter {n}/{n}: loss 3.0\n")
        else:
            open(out_path, "w").write(json.dumps({"nats_per_token": 3.0, "bits_per_byte": 1.4,
                                                  "tokens": 100}) + "\n")
        return 0, 1.0


def test_a_finished_run_is_retrained_when_anything_that_decides_it_changed(tmp_path, monkeypatch,
                                                                          capsys):
    trainer = FakeTrainer()
    monkeypatch.setattr(compare, "run_logged", trainer)
    monkeypatch.setattr(compare, "count_params", lambda d: 0)
    data = tmp_path / "data"
    data.mkdir()

    def once(args, arms, data_dir=str(data)):
        run = compare.plan_runs(args, arms)[0]
        before = trainer.trained
        compare.train_and_score(args, run, data_dir)
        return trainer.trained - before, capsys.readouterr()

    args = fake_args(tmp_path)
    arms = fake_arms(tmp_path, args)
    assert once(args, arms)[0] == 1
    assert once(args, arms)[0] == 0  # finished with the same everything: reused
    # the config file edited in place: same path, other contents, and compare run again (one
    # invocation trains on the contents it read at its start)
    (tmp_path / "cfg.py").write_text("n_layer = 2\n")
    args = fake_args(tmp_path)
    arms = fake_arms(tmp_path, args)
    trained, said = once(args, arms)
    assert trained == 1 and "config" in said.out + said.err
    assert once(args, arms)[0] == 0
    # other code (a new copy), another data folder, another flag: each retrains, and says so
    for change, word in [(lambda: (args, fake_arms(tmp_path, args, "tree-bbbb"), str(data)), "code"),
                         (lambda: (args, fake_arms(tmp_path, args, "tree-bbbb"),
                                   str(tmp_path / "data2")), "data"),
                         (lambda: (fake_args(tmp_path, "--dropout=0.1"),
                                   fake_arms(tmp_path, args, "tree-bbbb"), str(tmp_path / "data2")),
                          "flags")]:
        a, arms2, d = change()
        os.makedirs(d, exist_ok=True)
        trained, said = once(a, arms2, d)
        lines = [ln for ln in (said.out + said.err).splitlines() if word in ln]
        assert trained == 1 and len(lines) == 1, (word, said)


def test_seeds_split_over_processes_report_together(tmp_path, monkeypatch):
    """--first_seed: seeds 1337 and 1338 run in two --out folders (as two processes or machines
    would), their runs/ copied into a third, are the runs one --seeds=2 invocation plans there,
    and all of them are reused: nothing trains again."""
    trainer = FakeTrainer()
    monkeypatch.setattr(compare, "run_logged", trainer)
    monkeypatch.setattr(compare, "count_params", lambda d: 0)
    data = tmp_path / "data"
    data.mkdir()

    def runs(*argv):
        args = fake_args(tmp_path, "--variant=n_layer=2", *argv)
        return args, compare.plan_runs(args, fake_arms(tmp_path, args))

    for first, out in ((1337, "a"), (1338, "b")):
        args, planned = runs("--seeds=1", f"--first_seed={first}", f"--out={tmp_path / out}")
        assert {r["seed"] for r in planned} == {first}
        for run in planned:
            compare.train_and_score(args, run, str(data))
    assert trainer.trained == 4
    for out in ("a", "b"):
        shutil.copytree(tmp_path / out / "runs", tmp_path / "all" / "runs", dirs_exist_ok=True)
    args, planned = runs("--seeds=2", f"--out={tmp_path / 'all'}")
    assert sorted((r["arm"]["name"], r["seed"]) for r in planned) == [
        ("base", 1337), ("base", 1338), ("n_layer=2", 1337), ("n_layer=2", 1338)]
    assert [compare.train_and_score(args, r, str(data)) for r in planned] == ["reused"] * 4
    assert trainer.trained == 4
    with pytest.raises(compare.UserError, match="first_seed"):
        compare.parse_args(["--first_seed=-1", f"--out={tmp_path / 'o'}"])


def test_data_identity_changes_with_the_data(tmp_path):
    """The held-out folder (part of every run's key) is another folder when the dataset's files
    change, not only its meta.json."""
    from data import pipeline
    from test_eval import corpus_docs
    src = str(tmp_path / "src")
    pipeline.prepare(src, "tiny", [("docs", "docs", lambda: [t for _, t in corpus_docs()])],
                   "test", vocab_size=400, val_fraction=0.2, min_val_tokens=200, num_proc=1,
                   log=lambda *a: None)
    args = compare.parse_args([f"--data_dir={src}", "--dataset=tiny", f"--out={tmp_path / 'o'}",
                               "--eval_tokens=100"])
    first = compare.held_out_data(args)
    assert compare.held_out_data(args) == first
    # the same meta.json, a token of val.bin's slice changed
    val = np.fromfile(os.path.join(src, "val.bin"), dtype=np.uint16)
    val[5] = (val[5] + 1) % 400
    val.tofile(os.path.join(src, "val.bin"))
    assert compare.held_out_data(args) != first


def test_flags_and_variants_cannot_override_what_compare_sets(tmp_path):
    """Every key train_command puts on a run's command line (read from the command it builds: the
    reference) is refused, in one line naming it, as an extra flag and as a variant key."""
    args = fake_args(tmp_path)
    arms = fake_arms(tmp_path, args)
    cmd = compare.train_command(args, compare.plan_runs(args, arms)[0], "/data")
    own = {a[2:].split("=", 1)[0] for a in cmd[3:]} - set(compare.DEFAULT_MODEL)
    assert {"seed", "out_dir", "max_iters", "lr_decay_iters", "data_dir"} <= own
    for key in sorted(own | {"init_from"}):
        flag = f"--{key}=5"
        try:  # compare's own option (--max_iters, --data_dir, ...) sets it for every arm alike
            assert flag not in compare.parse_args([flag, f"--out={tmp_path / 'o'}"]).train_extra
            checks = ([f"--variant={key}=5"], [f"--variant=n_layer=2 {key}=5"])
        except compare.UserError:
            checks = ([flag], [f"--variant={key}=5"], [f"--variant=n_layer=2 {key}=5"])
        for argv in checks:
            with pytest.raises(SystemExit) as e:
                compare.main([str(tmp_path / "cfg.py"), f"--out={tmp_path / 'o'}", *argv])
            msg = str(e.value)
            assert msg.startswith("error:") and key in msg and "\n" not in msg, (argv, msg)
    for key in ("batch_size", "block_size", "short_iters"):  # an unequal budget
        with pytest.raises(SystemExit, match=f"error: .*{key}.*tokens"):
            compare.main([f"--variant={key}=64", f"--out={tmp_path / 'o'}"])
    for variant, word in [("", "empty"), ("  ", "empty"), ("n_layer=2 n_layer=3", "twice"),
                          ("n_layer=2 --n_layer=2", "twice")]:
        with pytest.raises(SystemExit) as e:
            compare.main([f"--variant={variant}", f"--out={tmp_path / 'o'}"])
        assert str(e.value).startswith("error:") and word in str(e.value), (variant, e.value)
    assert not os.path.exists(tmp_path / "o")  # refused before anything is built


def test_identical_differences_are_no_interval_not_certainty():
    for diffs in ([-0.0145] * 2, [0.02] * 5):
        r = stats.paired(diffs)
        assert r["ci95"] is None and r["p"] is None and r["mean"] == diffs[0], r
        assert "no interval" in compare_report.diff_cell(r)
    # no difference at all stays an exact zero (the same code, the same seeds)
    assert stats.paired([0.0, 0.0])["ci95"] == [0.0, 0.0]


def test_out_naming_a_file_and_absurd_seeds_are_one_line(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("")
    with pytest.raises(SystemExit) as e:
        compare.main([f"--out={f}"])
    assert str(e.value).startswith("error:") and "--out" in str(e.value)
    for argv in (["--seeds=1000000000"], ["--seeds=600", "--variant=base"]):
        with pytest.raises(compare.UserError, match="seeds"):
            compare.parse_args(argv + [f"--out={tmp_path / 'o'}"])
    compare.parse_args(["--seeds=20", "--variant=base", f"--out={tmp_path / 'o'}"])  # allowed


def test_run_folders_are_named_by_what_the_arm_is(tmp_path):
    def dirs(*variants):
        args = fake_args(tmp_path, "--seeds=2", *(f"--variant={v}" for v in variants))
        runs = compare.plan_runs(args, fake_arms(tmp_path, args))
        return {(r["arm"]["name"], r["seed"]): r["dir"] for r in runs}
    a = dirs("n_layer=2", "pos_encoding=learned", "base")
    b = dirs("base", "pos_encoding=learned")  # another list, other positions
    shared = set(a) & set(b)
    assert len(shared) == 6 and all(a[k] == b[k] for k in shared)
    assert len(set(a.values())) == len(a)  # distinct runs, distinct folders
    assert os.path.basename(a[("pos_encoding=learned", 1337)]).startswith("pos_encoding-learned")
    # other values are another arm; the same keys in another order are the same arm
    assert dirs("pos_encoding=learned n_layer=2")[("pos_encoding=learned n_layer=2", 1337)] \
        != dirs("pos_encoding=learned n_layer=3")[("pos_encoding=learned n_layer=3", 1337)]
    with pytest.raises(compare.UserError, match="twice"):
        dirs("n_layer=2 dropout=0.1", "dropout=0.1 --n_layer=2")


def test_progress_moves_while_a_run_trains(tmp_path):
    """run_logged hands each line the run prints to on_line while it runs, not at its end: a
    child that prints a line, then waits, is seen before it exits."""
    flag = tmp_path / "seen"
    code = ("import sys, time, os; print('iter 10/40: loss 3', flush=True); "
            f"t = time.time()\nwhile not os.path.exists({str(flag)!r}) and time.time() - t < 20: "
            "time.sleep(0.05)")
    seen = []

    def on_line(line):
        seen.append(line)
        flag.write_text("")  # let the child finish only once its line was seen
    t0 = __import__("time").time()
    rc, _ = compare.run_logged([sys.executable, "-c", code], str(tmp_path),
                               str(tmp_path / "out.txt"), on_line)
    assert rc == 0 and seen == ["iter 10/40: loss 3"]
    assert __import__("time").time() - t0 < 15  # it ended because its line was seen
    assert compare.iteration_of("iter 10/40: loss 3, eta 0:00:10") == 10
    assert compare.iteration_of("iter 40: train 3.1, val 3.2") == 40
    assert compare.iteration_of("MFU: n/a") is None


def test_progress_lines_off_a_terminal(capsys):
    """Where stderr is no terminal: a plain line per run as it starts and then (here at every
    call), with an estimate once an iteration has run, counting over all the runs."""
    import re
    p = compare.bench_runs.RunsProgress(2, 10, every=0)
    p.start(0, "base seed 1")
    p.at(0)
    p.at(5)
    p.end(trained=True)
    p.start(1, "x=1 seed 1")
    p.at(0)
    p.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    for ln, (k, it) in zip(lines, [(1, 0), (1, 5), (2, 0)]):
        assert re.fullmatch(rf"run {k}/2: .* seed 1: iteration {it}/10"
                            r"(, eta \d+:\d\d:\d\d for all runs)?", ln), ln
    assert "eta" not in lines[0] and "eta" in lines[1] and "eta" in lines[2]


def test_every_run_and_its_scoring_get_one_thread_count(tmp_path, monkeypatch):
    """One OMP_NUM_THREADS for all of a compare's commands: the user's when set, else chosen
    once (fewer than the cores when the machine is busy), so that arms run alike."""
    trainer = FakeTrainer()
    monkeypatch.setattr(compare, "run_logged", trainer)
    monkeypatch.setattr(compare, "count_params", lambda d: 0)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    args = fake_args(tmp_path, "--seeds=2", "--variant=n_layer=2")
    for run in compare.plan_runs(args, fake_arms(tmp_path, args)):
        compare.train_and_score(args, run, str(tmp_path))
    assert trainer.threads == ["3"] * 8  # 4 runs, each trained and scored
    monkeypatch.delenv("OMP_NUM_THREADS")
    from harness import device
    cores = len(os.sched_getaffinity(0))
    for busy, want in ((1, max(1, cores - 1)), (0, cores), (cores + 3, 1), (None, cores)):
        monkeypatch.setattr(device, "busy_cores", lambda: busy)
        assert fake_args(tmp_path).threads == str(want), busy
