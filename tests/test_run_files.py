"""A run's files changing under it or after it (issue 60's seventh sweep): a checkpoint whose
bytes changed, a dataset prepared again while a run trains or before it resumes, an out_dir that
is a dataset folder, an evaluation that is not finite, and the log's clock across a resume.
References: the files themselves (their bytes, torch.load's own reading), an unbroken run, and
the values the command was given."""
import os
import shutil
import sys
import zipfile

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_eval import make_run, one_line_error  # noqa: E402
from test_train import TINY, load, log, make_data, train, train_here  # noqa: E402
from test_train import one_line_error as one_line  # noqa: E402

import eval as evaluation  # noqa: E402
import export  # noqa: E402
import sample  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A prepared dataset (with its tokenizer) and a 4-iteration run on it."""
    root = str(tmp_path_factory.mktemp("runfiles"))
    out, data = make_run(root, iters=4)
    return {"root": root, "out": out, "data": data}


# ----------------------------------------------------------------------------------------
# item 11: a checkpoint whose bytes changed

def largest_member_data(path):
    """(offset, size) of the bytes of the largest member of the zip archive at `path` (a
    tensor's storage in a torch checkpoint), read from the archive's own headers."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = int.from_bytes(header[26:28], "little"), \
        int.from_bytes(header[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def damage(path, n=4096):
    """Invert n bytes in the middle of the largest tensor's storage of the checkpoint."""
    offset, size = largest_member_data(path)
    assert size >= n, (size, n)
    at = offset + (size - n) // 2
    with open(path, "r+b") as f:
        f.seek(at)
        block = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in block))


@pytest.fixture
def damaged(run, tmp_path):
    out = str(tmp_path / "out")
    shutil.copytree(run["out"], out)
    path = os.path.join(out, "ckpt.pt")
    before = torch.load(path, map_location="cpu", weights_only=True)
    damage(path)
    after = torch.load(path, map_location="cpu", weights_only=True)  # torch sees nothing
    changed = [k for k in before["model"] if not torch.equal(before["model"][k],
                                                              after["model"][k])]
    changed += [i for i in before["optimizer"]["state"] for k in before["optimizer"]["state"][i]
                if not torch.equal(before["optimizer"]["state"][i][k],
                                   after["optimizer"]["state"][i][k])]
    assert changed, "the damage changed no tensor: the test damages the wrong bytes"
    return out, path


def test_a_damaged_checkpoint_is_refused_by_sample_eval_and_export(damaged, run, tmp_path):
    out, path = damaged
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 8)
    for fn, args in ((sample.main, [f"--out_dir={out}", "--max_new_tokens=4", "--device=cpu"]),
                     (evaluation.main, [f"--out_dir={out}", f"--input={text}", "--device=cpu"]),
                     (export.main, [f"--out_dir={out}", f"--hf_dir={tmp_path / 'hf'}"])):
        msg = one_line_error(fn, args)
        assert path in msg and "changed since it was saved" in msg, (fn, msg)


def test_a_damaged_checkpoint_is_refused_by_resume_and_init_from(damaged, run, tmp_path):
    out, path = damaged
    common = [f"--data_dir={run['data']}", "--dataset=tiny", "--n_layer=2", "--n_head=2",
              "--n_embd=32", "--block_size=32", "--batch_size=8", "--compile=False",
              "--eval_iters=2", "--dtype=float32"]
    for args in (["--init_from=resume", f"--out_dir={out}", "--max_iters=6"],
                 [f"--init_from={out}", f"--out_dir={tmp_path / 'new'}", "--max_iters=2"]):
        msg = one_line(train_here(*common, *args))
        assert path in msg and "changed since it was saved" in msg, msg


def test_an_intact_checkpoint_and_one_without_a_digest_load(run, tmp_path, capsys):
    """The digest refuses only a changed file: the run's own samples, and so does a checkpoint
    written before digests (the key removed), byte for byte the same text."""
    sample.main([f"--out_dir={run['out']}", "--max_new_tokens=8", "--device=cpu", "--seed=3"])
    want = capsys.readouterr().out
    old = str(tmp_path / "old")
    shutil.copytree(run["out"], old)
    ckpt = torch.load(os.path.join(old, "ckpt.pt"), weights_only=True)
    assert "digest" in ckpt
    del ckpt["digest"]
    torch.save(ckpt, os.path.join(old, "ckpt.pt"))
    sample.main([f"--out_dir={old}", "--max_new_tokens=8", "--device=cpu", "--seed=3"])
    assert capsys.readouterr().out == want


@pytest.mark.slow
def test_a_damaged_fsdp_shard_folder_is_refused_on_resume(tmp_path):
    """An FSDP run's ckpt.pt names a DCP folder that holds the optimizer's shards: its files'
    digest is in ckpt.pt, checked before they are loaded (here by one process, resharding)."""
    data, out = make_data(str(tmp_path / "data")), str(tmp_path / "out")
    common = [f"--data_dir={data}", f"--out_dir={out}", *TINY, "--dtype=float32"]
    from test_train import torchrun
    torchrun(2, *common, "--max_iters=2", "--fsdp=True", "--gradient_accumulation_steps=2")
    folder = os.path.join(out, load(out)["sharded"])
    shard = max((os.path.join(folder, f) for f in os.listdir(folder)), key=os.path.getsize)
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:  # 4 KiB inverted in the middle of the largest shard file
        f.seek(size // 2 - 2048)
        block = f.read(4096)
        f.seek(size // 2 - 2048)
        f.write(bytes(b ^ 0xFF for b in block))
    msg = one_line(train_here(*common, "--max_iters=4", "--init_from=resume",
                              "--gradient_accumulation_steps=2"))
    assert folder in msg and "changed since" in msg, msg


# ----------------------------------------------------------------------------------------
# item 12: a dataset prepared again while a run trains

def another_dataset(d, in_place):
    """Prepare d again under a run: other ids (another tokenizer's), published as prepare
    publishes them (a temp file renamed into place), or written into the open files."""
    rng = np.random.default_rng(1)
    for split in ("train", "val"):
        path = os.path.join(d, f"{split}.bin")
        n = os.path.getsize(path) // 2
        ids = rng.integers(0, 64, n).astype(np.uint16)
        if in_place:
            with open(path, "r+b") as f:
                f.write(ids.tobytes())
        else:
            ids.tofile(path + ".tmp")
            os.replace(path + ".tmp", path)


def train_and_prepare_again(data, out, args, in_place):
    """train.py on `data`, which is prepared again once the evaluation at iteration 0 is logged
    (the run stopped meanwhile, so that it has iterations left). Returns (exit code, stderr)."""
    import signal
    import subprocess
    from test_train import TRAIN, env
    p = subprocess.Popen([sys.executable, TRAIN, f"--data_dir={data}", f"--out_dir={out}", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=env())
    for line in p.stdout:
        if line.startswith("iter 0: train"):
            p.send_signal(signal.SIGSTOP)
            break
    another_dataset(data, in_place)
    p.send_signal(signal.SIGCONT)
    stdout, stderr = p.communicate(timeout=300)
    return p.returncode, stdout, stderr


RUN_ARGS = [*TINY, "--dtype=float32", "--max_iters=60", "--eval_interval=20"]


def test_a_run_trains_on_the_data_it_started_with(tmp_path):
    """Reference: the same run on a dataset nobody touched. The weights, and every
    evaluation in the log, are that run's."""
    ref, out = str(tmp_path / "ref"), str(tmp_path / "out")
    train(f"--data_dir={make_data(str(tmp_path / 'd1'))}", f"--out_dir={ref}", *RUN_ARGS)
    code, stdout, stderr = train_and_prepare_again(make_data(str(tmp_path / "d2")), out,
                                                   RUN_ARGS, in_place=False)
    assert code == 0, stderr[-2000:]
    a, b = load(ref), load(out)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert [r["val_loss"] for r in log(ref)] == [r["val_loss"] for r in log(out)]
    assert "was prepared again" in stdout


def test_a_dataset_rewritten_in_place_under_a_run_stops_it_in_one_line(tmp_path):
    data, out = make_data(str(tmp_path / "d")), str(tmp_path / "out")
    code, stdout, stderr = train_and_prepare_again(data, out, RUN_ARGS, in_place=True)
    msg = one_line(type("R", (), {"returncode": code, "stderr": stderr})())
    assert os.path.join(data, "train.bin") in msg and "rewritten" in msg, msg
    assert not os.path.exists(os.path.join(out, "ckpt.pt"))  # nothing saved from other data


# ----------------------------------------------------------------------------------------
# item 13: an evaluation that is not finite is never saved, nor called good

DIVERGE = ["--learning_rate=1e6", "--grad_clip=0", "--warmup_iters=0", "--min_lr=0",
           "--eval_interval=1"]


def test_a_nan_evaluation_is_not_saved(tmp_path):
    """A learning rate of 1e6 without clipping: the weights are NaN after the first step, which
    the evaluation at iteration 1 sees before any step's loss does."""
    data, out = make_data(str(tmp_path / "d")), str(tmp_path / "out")
    r = train_here(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--dtype=float32",
                   "--max_iters=6", *DIVERGE)
    assert not os.path.exists(os.path.join(out, "ckpt.pt"))
    msg = one_line(r)
    assert "non-finite loss at iteration 1 (evaluation: train nan, val nan)" in msg, msg
    assert "no checkpoint was saved" in msg and "--learning_rate" in msg, msg


def test_the_checkpoint_called_good_after_a_nan_evaluation_is_good(tmp_path):
    """A run resumed with a diverging rate stops at the first evaluation that is not finite;
    the checkpoint the message names holds finite weights from before it, and resumes."""
    import re
    data, out = make_data(str(tmp_path / "d")), str(tmp_path / "out")
    common = [f"--data_dir={data}", f"--out_dir={out}", *TINY, "--dtype=float32"]
    train(*common, "--max_iters=2")
    path = os.path.join(out, "ckpt.pt")
    msg = one_line(train_here(*common, "--max_iters=8", "--init_from=resume", *DIVERGE))
    stopped = int(re.search(r"non-finite loss at iteration (\d+) \(evaluation", msg).group(1))
    assert f"the last good checkpoint is {path}" in msg, msg
    ckpt = load(out)
    assert 2 <= ckpt["iter_num"] < stopped
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert all(np.isfinite(r["val_loss"]) for r in log(out))
    train(*common, "--max_iters=9", "--init_from=resume")
    assert all(torch.isfinite(t).all() for t in load(out)["model"].values())


# ----------------------------------------------------------------------------------------
# item 14: out_dir is a dataset folder

@pytest.mark.parametrize("which", ["its own", "another"])
def test_an_out_dir_that_is_a_dataset_folder_is_refused(tmp_path, which):
    data = make_data(str(tmp_path / "d"))
    out = data if which == "its own" else make_data(str(tmp_path / "other"))
    before = sorted(os.listdir(out))
    msg = one_line(train_here(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=1"))
    assert f"out_dir {out} " in msg and "--out_dir" in msg, msg
    assert sorted(os.listdir(out)) == before  # nothing written there


# ----------------------------------------------------------------------------------------
# item 16: resuming after the dataset was prepared again, or without naming it

def with_tokenizer(d, text):
    from test_train import tokenizer_model
    tokenizer_model(os.path.join(d, "tokenizer.model"), text)
    return d


TEXT = ". ".join(f"alpha beta gamma {i} delta epsilon" for i in range(300))


def test_resume_after_a_re_prepare_names_the_folder_once_and_the_way_on(tmp_path):
    data = with_tokenizer(make_data(str(tmp_path / "d")), TEXT)
    out = str(tmp_path / "out")
    common = [f"--data_dir={data}", f"--out_dir={out}", *TINY]
    train(*common, "--max_iters=2")
    with_tokenizer(data, TEXT.replace("alpha", "omega"))  # the folder prepared again
    msg = one_line(train_here(*common, "--max_iters=4", "--init_from=resume"))
    path = os.path.join(data, "tokenizer.model")
    assert msg.count(path) == 1 and "prepared again" in msg, msg
    assert f"--tokenizer={out}" in msg, msg


@pytest.fixture
def no_build(monkeypatch):
    """harness/dataset.py's build of the default corpus, recorded instead of run (minutes)."""
    import subprocess
    from harness import dataset
    calls = []
    def fake(cmd, *args, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)
    monkeypatch.setattr(dataset, "subprocess", type("NoBuild", (), {"run": staticmethod(fake)}))
    return calls


def test_resume_without_dataset_flags_reads_the_checkpoints_dataset(tmp_path, no_build):
    data = with_tokenizer(make_data(str(tmp_path / "d")), TEXT)
    out = str(tmp_path / "out")
    train(f"--data_dir={data}", "--dataset=tiny", f"--out_dir={out}", *TINY, "--max_iters=2")
    r = train_here(f"--out_dir={out}", "--max_iters=3", "--init_from=resume", "--compile=False")
    assert r.returncode == 0 and not no_build, (no_build, r.stderr[-2000:])
    assert load(out)["iter_num"] == 3 and load(out)["config"]["data_dir"] == data


def test_resume_whose_dataset_is_gone_says_so_and_builds_nothing(tmp_path, no_build):
    data = with_tokenizer(make_data(str(tmp_path / "d")), TEXT)
    out = str(tmp_path / "out")
    train(f"--data_dir={data}", "--dataset=tiny", f"--out_dir={out}", *TINY, "--max_iters=2")
    shutil.rmtree(data)
    msg = one_line(train_here(f"--out_dir={out}", "--max_iters=3", "--init_from=resume",
                              "--compile=False"))
    assert data in msg and "--data_dir" in msg and not no_build, (msg, no_build)


# ----------------------------------------------------------------------------------------
# item 19: log.jsonl's clock goes on across a resume

@pytest.mark.parametrize("older", [False, True])
def test_time_s_goes_on_after_a_resume(tmp_path, older):
    """10 iterations, then 2 more resumed: the resumed evaluation's time_s is past the time
    logged at the checkpoint (whose own time_s is at least that), as tokens are. `older`: a
    checkpoint from before the key (and the digest) goes on from its log's last time."""
    data, out = make_data(str(tmp_path / "d")), str(tmp_path / "out")
    common = [f"--data_dir={data}", f"--out_dir={out}", *TINY, "--dtype=float32"]
    train(*common, "--max_iters=10", "--eval_interval=5")
    at_ckpt = log(out)[-1]
    assert at_ckpt["iter"] == 10
    if older:
        ckpt = load(out)
        ckpt.pop("time_s", None), ckpt.pop("digest", None)
        torch.save(ckpt, os.path.join(out, "ckpt.pt"))
    train(*common, "--max_iters=12", "--eval_interval=2", "--init_from=resume")
    records = log(out)
    assert [r["iter"] for r in records] == [0, 5, 10, 12]
    assert records[-1]["time_s"] > at_ckpt["time_s"], records
    assert records[-1]["tokens"] > at_ckpt["tokens"]


def test_preparing_into_a_run_folder_is_refused(run, tmp_path):
    """A run trained into its dataset folder before train.py refused one: preparing that
    folder again would replace the run's tokenizer copy, so prepare refuses it, changing
    nothing."""
    from data import pipeline
    from test_eval import corpus_docs
    folder = str(tmp_path / "both")
    shutil.copytree(run["data"], folder)
    shutil.copy(os.path.join(run["out"], "ckpt.pt"), folder)
    before = {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)}
    texts = [t for _, t in corpus_docs()]
    msg = one_line_error(lambda: pipeline.prepare(
        folder, "tiny", [("docs", "docs", lambda: texts)], "test", vocab_size=300, num_proc=1,
        log=lambda *a: None))
    assert folder in msg and "--out_dir" in msg, msg
    assert {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)} == before
