"""bench/compare.py reports only what it measured (issue 60, the seventh sweep): a run stopped
early is not scored, an arm on other tokens is not compared, the config file is read once and
every run checked against that snapshot before the report, a config file cannot set what
compare sets, --out inside the tree changes no run's identity, results.md gives the per-seed
differences, the timings' noise and a plot at the differences' scale, and no step runs silent.
train.py and eval.py are stubbed (a scripted trainer writes what they would): each test is
compare's whole main in a second or two."""
import hashlib
import json
import math
import os
import subprocess

import pytest
import scipy.stats

from test_compare import FakeTrainer, compare, compare_report, fake_args, fake_arms

SLUG = {"base": "base", "n_layer-2": "n_layer=2", "n_layer-3": "n_layer=3"}


def who(cmd):
    """(arm name, seed) of a stubbed train.py or eval.py command, from its run folder's name."""
    flags = dict(a[2:].split("=", 1) for a in cmd[2:] if a.startswith("--"))
    folder, _, seed = os.path.basename(flags["out_dir"]).rpartition("_s")
    return SLUG[folder.rsplit("-", 1)[0]], int(seed), flags


class ScriptedTrainer(FakeTrainer):
    """FakeTrainer with what each (arm, seed) measures: its val curve (one value per
    evaluation, the last one also eval.py's score), tokens/s, iterations reached and tokens per
    iteration; an arm or seed not in `script` gets the defaults."""
    def __init__(self, script=None, on_train=None):
        super().__init__()
        self.script, self.on_train, self.lines = script or {}, on_train, []

    def __call__(self, cmd, cwd, out_path, on_line=None, env=None):
        name, seed, flags = who(cmd)
        s = dict({"curve": [8.0, 5.0, 4.0], "tps": 1000.0, "iters": None, "per_iter": 64},
                 **self.script.get(name, {}), **self.script.get((name, seed), {}))
        n = int(flags.get("max_iters", 0))
        if cmd[1].endswith("eval.py"):
            open(out_path, "w").write(json.dumps({"nats_per_token": s["curve"][-1], "tokens": 100,
                                                  "bits_per_byte": s["curve"][-1] / 2}) + "\n")
            return 0, 1.0
        self.trained += 1
        if self.on_train:
            self.on_train(self, cmd)
        reached = s["iters"] if s["iters"] is not None else n
        its = [round(reached * k / (len(s["curve"]) - 1)) for k in range(len(s["curve"]))]
        with open(os.path.join(flags["out_dir"], "ckpt.pt"), "w") as f:
            f.write("x")
        with open(os.path.join(flags["out_dir"], "log.jsonl"), "w") as f:
            for it, loss in zip(its, s["curve"]):
                tokens = it * s["per_iter"]
                f.write(json.dumps({"iter": it, "tokens": tokens, "val_loss": loss,
                                    "time_s": max(tokens, 1) / s["tps"]}) + "\n")
        for it in its:
            if on_line:
                on_line(f"iter {it}/{n}: loss 3.0")
        open(out_path, "w").write(f"iter {reached}/{n}: loss 3.0\n")
        return 0, 1.0


def run_main(tmp_path, monkeypatch, trainer, *argv, plot=False):
    """compare.main over the stubbed trainer, a stubbed working-tree copy and held-out folder;
    returns results.json's records by arm."""
    monkeypatch.setattr(compare, "run_logged", trainer)
    monkeypatch.setattr(compare, "count_params", lambda d: 0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if not plot:
        monkeypatch.setattr(compare_report.bench_runs, "pyplot", lambda: None)
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    monkeypatch.setattr(compare, "held_out_data", lambda args: str(data))
    code = tmp_path / "out" / "code" / "tree-aaaa"
    code.mkdir(parents=True, exist_ok=True)
    (code / "model.py").write_text("x = 1\n")
    monkeypatch.setattr(compare, "worktree_code", lambda out: str(code))
    config = tmp_path / "cfg.py"
    if not config.exists():
        config.write_text("n_layer = 1\n")
    compare.main([str(config), f"--out={tmp_path / 'out'}", "--max_iters=4", *argv])
    with open(tmp_path / "out" / "results.json") as f:
        return {rec["arm"]: rec for rec in json.load(f)}


def main_table(tmp_path):
    """results.md's main table: {arm: its cells}, the header under 'arm'."""
    md = open(tmp_path / "out" / "results.md").read().split("Per-seed differences")[0]
    rows = [ln.split(" | ") for ln in md.splitlines() if ln.startswith("| ")]
    return {cells[0][2:]: cells for cells in rows}


def one_line_error(e):
    msg = str(e.value)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


# ----------------------------------------------------------------------------------------
# 1. a run stopped early is not scored; tokens per arm, and an unequal budget refused

def test_a_run_stopped_early_is_not_scored_as_finished(tmp_path, monkeypatch, capsys):
    """train.py signalled mid-run saves and exits 0, its log ending at the iteration it reached
    (here 1 of 4): that arm is refused in one line that names the iteration and the way out,
    and nothing of it is reported as a difference."""
    trainer = ScriptedTrainer({("n_layer=2", 1338): {"iters": 1}})
    records = run_main(tmp_path, monkeypatch, trainer, "--seeds=2", "--variant=n_layer=2")
    out = capsys.readouterr().out
    broken = records["n_layer=2"]["broken"]
    assert broken and "stopped at iteration 1 of 4" in broken and "again" in broken, broken
    assert "loss_diff" not in records["n_layer=2"]
    assert all(r["iters"] == 4 for r in records["base"]["runs"])
    errors = [ln for ln in out.splitlines() if ln.startswith("error:") and "n_layer=2" in ln]
    assert len(errors) == 1 and "iteration 1 of 4" in errors[0], out
    md = open(tmp_path / "out" / "results.md").read()
    assert "| n_layer=2 | 1 | broken: train.py stopped at iteration 1 of 4" in md, md
    # the base stopped (another --out): no comparison at all, one line
    trainer = ScriptedTrainer({("base", 1337): {"iters": 2}})
    (tmp_path / "b").mkdir()
    with pytest.raises(SystemExit) as e:
        run_main(tmp_path / "b", monkeypatch, trainer, "--seeds=1", "--variant=n_layer=3")
    assert "the base is broken: train.py stopped at iteration 2 of 4" in one_line_error(e)


def test_an_arm_on_other_tokens_is_refused_and_tokens_shown_per_arm(tmp_path, monkeypatch):
    """Every iteration reached, but the variant's runs drew half the tokens (as a patch changing
    the batch would): not compared; each arm's tokens per run are in results.md's table."""
    trainer = ScriptedTrainer({"n_layer=2": {"per_iter": 32}})
    records = run_main(tmp_path, monkeypatch, trainer, "--seeds=2", "--variant=n_layer=2",
                       "--variant=n_layer=3")
    assert records["n_layer=2"]["broken"].startswith(
        "trained on 128 tokens per run, the base on 256: not an equal budget")
    assert "loss_diff" not in records["n_layer=2"] and records["n_layer=3"]["loss_diff"]
    rows = main_table(tmp_path)
    assert rows["arm"][2] == "tokens/run"
    assert rows["base"][2] == rows["n_layer=3"][2] == "256"
    assert "broken: trained on 128 tokens per run" in " | ".join(rows["n_layer=2"])


# ----------------------------------------------------------------------------------------
# 2. the config file read once; every run's key checked again before the report

def test_a_config_edited_while_compare_runs_changes_no_run(tmp_path, monkeypatch, capsys):
    """The file is edited while the first run trains: every run still trains on the contents
    read at the start, every run's key holds that snapshot's hash, and a note says so."""
    (tmp_path / "cfg.py").write_text("n_layer = 1\n")
    seen = []

    def edit(trainer, cmd):
        seen.append(open(cmd[2]).read())  # the config file train.py would read
        (tmp_path / "cfg.py").write_text("n_layer = 1\ndropout = 0.5\n")
    run_main(tmp_path, monkeypatch, ScriptedTrainer(on_train=edit), "--seeds=2",
             "--variant=n_layer=2")
    assert seen == ["n_layer = 1\n"] * 4
    want = hashlib.sha256(b"n_layer = 1\n").hexdigest()
    keys = [json.load(open(tmp_path / "out" / "runs" / d / "run_key.json"))
            for d in os.listdir(tmp_path / "out" / "runs")]
    assert len(keys) == 4 and {k["config file"] for k in keys} == {want}
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "cfg.py changed while compare ran" in notes[0], notes


def test_a_run_changed_by_another_process_is_not_reported(tmp_path, monkeypatch):
    """Another compare in the same --out retrains the first run (another key on disk) while
    this one trains the rest: refused before any report, in one line naming the folder."""
    def other_process(trainer, cmd):
        if trainer.trained == 4:
            first = min((tmp_path / "out" / "runs").iterdir())
            key = json.load(open(first / "run_key.json"))
            key["flags"] = key["flags"] + ["--dropout=0.5"]
            (first / "run_key.json").write_text(json.dumps(key))
    with pytest.raises(SystemExit) as e:
        run_main(tmp_path, monkeypatch, ScriptedTrainer(on_train=other_process), "--seeds=2",
                 "--variant=n_layer=2")
    msg = one_line_error(e)
    assert "changed while this compare ran (its flags" in msg and "own --out" in msg, msg
    assert not (tmp_path / "out" / "results.json").exists()


# ----------------------------------------------------------------------------------------
# 3. a config file cannot set what compare controls

def test_a_config_file_cannot_set_init_from(tmp_path, monkeypatch):
    """init_from in the config file would start every arm from another run's weights (compare
    puts no init_from on the command line to override it): refused as the flag and the variant
    key are, before anything is built. Keys compare overrides on the command line (max_iters,
    out_dir, as config/small.py sets them) and init_from = "scratch" stay allowed."""
    cfg = tmp_path / "cfg.py"
    for line in ('init_from = "out/other_run"', "init_from = 'resume'"):
        cfg.write_text(f"n_layer = 1\n{line}\n")
        with pytest.raises(SystemExit) as e:
            run_main(tmp_path, monkeypatch, ScriptedTrainer(), "--seeds=1")
        msg = one_line_error(e)
        assert str(cfg) in msg and "init_from" in msg and line.split(" = ")[1].strip("'\"") in msg, msg
        assert "remove that line" in msg
        assert not (tmp_path / "out" / "runs").exists()
    cfg.write_text('init_from = "scratch"\nmax_iters = 300\nout_dir = "out-small"\n')
    records = run_main(tmp_path, monkeypatch, ScriptedTrainer(), "--seeds=1")
    assert records["base"]["runs"][0]["iters"] == 4


# ----------------------------------------------------------------------------------------
# 4. --out inside the tree; what no run reads; a retrain names the file

def test_out_inside_the_tree_is_not_part_of_the_code(tmp_path, monkeypatch):
    """A git checkout with --out inside it, not ignored: the working tree's copy holds neither
    --out's files nor what no run reads (tests, docs), so a second compare (whose --out now
    holds results, runs and the first copy) and edits of docs and tests reuse the same copy;
    an edit of model.py makes a new one, whose retrain names model.py."""
    repo = tmp_path / "repo"
    for name, text in [("train.py", "t\n"), ("model.py", "m\n"), ("harness/x.py", "h\n"),
                       ("docs/A.md", "d\n"), ("tests/test_x.py", "x\n")]:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.setattr(compare.bench_runs, "ROOT", str(repo))
    out = repo / "lab"
    first = compare.bench_runs.worktree_code(str(out))
    (out / "runs" / "base-1_s1337").mkdir(parents=True)
    (out / "runs" / "base-1_s1337" / "ckpt.pt").write_bytes(os.urandom(1000))
    (out / "results.json").write_text("[]")
    (repo / "docs" / "A.md").write_text("d, edited\n")
    (repo / "tests" / "test_x.py").write_text("x, edited\n")
    assert compare.bench_runs.worktree_code(str(out)) == first
    copied = sorted(os.path.relpath(os.path.join(d, f), first)
                    for d, _, fs in os.walk(first) for f in fs)
    assert copied == ["harness/x.py", "model.py", "train.py"]
    (repo / "model.py").write_text("m, edited\n")
    second = compare.bench_runs.worktree_code(str(out))
    assert second != first
    old, new = (compare.code_identity(c) for c in (first, second))
    assert set(old) == set(new) == {"harness/x.py", "model.py", "train.py"}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run_key.json").write_text(json.dumps({"code": old, "flags": []}))
    why = compare.bench_runs.stale(str(run_dir), {"code": new, "flags": []}, 4)
    assert why == "its code (model.py) changed since it was trained", why


def test_a_retrain_names_the_file_that_changed(tmp_path, monkeypatch, capsys):
    trainer = FakeTrainer()
    monkeypatch.setattr(compare, "run_logged", trainer)
    monkeypatch.setattr(compare, "count_params", lambda d: 0)
    args = fake_args(tmp_path)
    for code in ("tree-aaaa", "tree-bbbb"):
        compare.train_and_score(args, compare.plan_runs(args, fake_arms(tmp_path, args, code))[0],
                                str(tmp_path))
    said = [ln for ln in capsys.readouterr().out.splitlines() if "trained again" in ln]
    assert said == ["base seed 1337: trained again (its code (model.py) changed since it was "
                    "trained)"], said
    assert trainer.trained == 2


# ----------------------------------------------------------------------------------------
# 5. results.md: per-seed differences, the timings' noise, the plot at the differences' scale

BASE_FINAL = {1337: 4.00, 1338: 4.10, 1339: 3.95}
DIFFS = {"n_layer=2": [0.01, 0.03, 0.02], "n_layer=3": [0.06, 0.05, 0.04]}
TPS = {"base": [1000, 1250, 800], "n_layer=2": [1150, 1000, 1000],  # the same work, a noisy
       "n_layer=3": [500, 630, 390]}                                 # machine; half as fast


def three_arms():
    script = {}
    for arm, tps in TPS.items():
        for k, seed in enumerate(BASE_FINAL):
            final = BASE_FINAL[seed] + (DIFFS[arm][k] if arm in DIFFS else 0.0)
            script[(arm, seed)] = {"curve": [8.3, 5.0, final], "tps": float(tps[k])}
    return ScriptedTrainer(script)


def test_results_give_per_seed_differences(tmp_path, monkeypatch):
    records = run_main(tmp_path, monkeypatch, three_arms(), "--seeds=3", "--variant=n_layer=2",
                       "--variant=n_layer=3")
    md = open(tmp_path / "out" / "results.md").read().splitlines()
    assert "| arm | seed 1337 | seed 1338 | seed 1339 |" in md
    for arm, diffs in DIFFS.items():
        got = [(d["seed"], d["base_seed"], d["loss"]) for d in records[arm]["per_seed_diffs"]]
        assert [(s, b) for s, b, _ in got] == [(s, s) for s in BASE_FINAL]
        assert all(abs(g - want) < 1e-9 for (_, _, g), want in zip(got, diffs))
        assert f"| {arm} | " + " | ".join(f"{d:+.4f}" for d in diffs) + " |" in md, md


def test_timings_within_the_machines_noise_are_said_so(tmp_path, monkeypatch):
    """The reference: scipy's t interval of the per-seed log ratios of tokens/s (arm / base of
    the same seed); within noise where it covers 1x. The same work on a noisy machine reads
    within noise; an arm twice as slow does not."""
    records = run_main(tmp_path, monkeypatch, three_arms(), "--seeds=3", "--variant=n_layer=2",
                       "--variant=n_layer=3")
    md = main_table(tmp_path)
    for arm, within in (("n_layer=2", True), ("n_layer=3", False)):
        logs = [math.log(a / b) for a, b in zip(TPS[arm], TPS["base"])]
        lo, hi = (math.exp(x) for x in scipy.stats.ttest_1samp(logs, 0).confidence_interval(0.95))
        assert (lo <= 1 <= hi) == within  # the reference agrees with the design of the data
        noise = records[arm]["tokens_per_s_noise"]
        assert abs(noise["ci95"][0] - lo) < 1e-6 and abs(noise["ci95"][1] - hi) < 1e-6, noise
        assert noise["within_noise"] == within
        assert ("(within noise)" in md[arm][7]) == within, md[arm]
    # the time to the base's final loss (4.0167): reached at the last evaluation by seeds 1337
    # and 1339 of n_layer=2, at 256 tokens / its tokens/s, against the base's 256 / tokens/s
    ratios = [TPS["base"][k] / TPS["n_layer=2"][k] for k in (0, 2)]
    lo, hi = (math.exp(x) for x in
              scipy.stats.ttest_1samp(list(map(math.log, ratios)), 0).confidence_interval(0.95))
    noise = records["n_layer=2"]["time_to_base_loss_noise"]
    assert abs(noise["ci95"][0] - lo) < 1e-6 and noise["within_noise"] == (lo <= 1 <= hi)
    assert ("(within noise)" in md["n_layer=2"][10]) == (lo <= 1 <= hi), md["n_layer=2"]


def test_the_plot_is_drawn_at_the_differences_scale(tmp_path, monkeypatch):
    """Val losses run from 8.3 to 4; the differences are 0.01-0.06: every panel's y-axis holds
    the differences and spans less than 0.2 nats."""
    pytest.importorskip("matplotlib")
    limits = []
    real = compare_report.bench_runs.save_figure

    def keep(plt, fig, path, dpi):
        limits.extend(ax.get_ylim() for ax in fig.axes)
        return real(plt, fig, path, dpi)
    monkeypatch.setattr(compare_report.bench_runs, "save_figure", keep)
    run_main(tmp_path, monkeypatch, three_arms(), "--seeds=3", "--variant=n_layer=2",
             "--variant=n_layer=3", plot=True)
    assert len(limits) == 2 and (tmp_path / "out" / "compare.png").exists()
    for lo, hi in limits:
        assert lo <= 0.0 and hi >= 0.06 and hi - lo < 0.2, limits


# ----------------------------------------------------------------------------------------
# 18. no silent wait: a line as each silent step of a run starts

def test_each_silent_step_of_a_run_is_said_as_it_starts(tmp_path, monkeypatch, capsys):
    """train.py's start (torch, the model) and eval.py's scoring print nothing for seconds:
    off a terminal a line says each as it starts, in order, for every run; iteration lines
    come at most every 10 s."""
    run_main(tmp_path, monkeypatch, ScriptedTrainer(), "--seeds=1", "--variant=n_layer=2",
             "--eval_tokens=300")
    lines = capsys.readouterr().out.splitlines()
    want = []
    for k, arm in enumerate(("base", "n_layer=2")):
        want += [f"run {k + 1}/2: {arm} seed 1337: starting train.py",
                 f"run {k + 1}/2: {arm} seed 1337: scoring 300 held-out tokens (eval.py)"]
    assert [ln for ln in lines if ln in want] == want, lines
    assert compare.bench_runs.RunsProgress(1, 10).every <= 10
