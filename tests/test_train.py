"""train.py end to end, in subprocesses, on tiny data made here. The references are other
runs: an unbroken run for resume and restart, one process for DDP, the first checkpoint for
a failing run, the files themselves (sha256) for the tokenizer identity."""
import atexit
import contextlib
import glob
import hashlib
import importlib.util
import io
import json
import os
import random
import re
import runpy
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
V = 64
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--eval_iters=2", "--compile=False", "--warmup_iters=2", "--lr_decay_iters=40",
        "--learning_rate=3e-3", "--min_lr=3e-4"]


def make_data(d):
    """A learnable stream: counting mod V with 10% noise tokens, so the loss can fall well
    below ln(V)."""
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 20000), ("val", 4000)):
        base = np.arange(n) % V
        noisy = np.where(rng.random(n) < 0.1, rng.integers(0, V, n), base)
        noisy.astype(np.uint16).tofile(os.path.join(d, f"{split}.bin"))
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"name": "tiny", "vocab_size": V, "dtype": "uint16", "eos_id": 0,
                   "bos_id": 1}, f)
    return d


def tokenizer_model(path, text):
    """A small sentencepiece model trained on `text` (sentences split at ". ") written to path:
    train.py refuses a tokenizer.model that sentencepiece cannot load. Returns its bytes."""
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.split(". ")), model_writer=buf,
                                   vocab_size=64, hard_vocab_limit=False, minloglevel=2)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return buf.getvalue()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("data")))


# The runs' XDG_CACHE_HOME: a folder of this test session, not the user's
CACHE = tempfile.mkdtemp(prefix="roformer-test-cache-")
atexit.register(shutil.rmtree, CACHE, True)


def env(**extra):
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", XDG_CACHE_HOME=CACHE)
    e.pop("RANK", None)
    e.update(extra)
    return e


def train(*args, check=True, **extra):
    r = subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True,
                       cwd=ROOT, env=env(**extra))
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def train_here(*args, **extra):
    """train.py in this process, for commands that must stop with an error: what train()
    returns, without a new interpreter importing torch (~1 s a command). An exception that
    escapes goes to train.py's own sys.excepthook, as it would at the end of the script, and
    the process-wide state train.py may touch (cwd, environment, excepthook, signal handlers,
    global RNGs, harness.common's lists of folders and files made) is put back afterwards, and the
    out_dir lock a run took is let go (a process ending does that for a real run)."""
    from harness import common, out_dir
    saved = (os.getcwd(), dict(os.environ), sys.argv, sys.excepthook, random.getstate(),
             np.random.get_state(), torch.get_rng_state(),
             (list(common.created_dirs), list(common.created_files)),
             {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)})
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        os.chdir(ROOT)
        os.environ.clear()
        os.environ.update(env(**extra))
        sys.argv = [TRAIN, *args]
        common.created_dirs.clear()
        common.created_files.clear()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings_to(err):
            try:
                runpy.run_path(TRAIN, run_name="__main__")
            except SystemExit as e:  # what the interpreter makes of sys.exit(code)
                code = e.code or 0
                if not isinstance(code, int):
                    print(code, file=sys.stderr)
                    code = 1
            except Exception as e:
                sys.excepthook(type(e), e, e.__traceback__)
                code = 1
    finally:
        cwd, environ, sys.argv, sys.excepthook, r, n, t, made, handlers = saved
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        random.setstate(r)
        np.random.set_state(n)
        torch.set_rng_state(t)
        common.created_dirs[:], common.created_files[:] = made
        while out_dir.out_dir_lock:
            os.close(out_dir.out_dir_lock.pop())
        for s, h in handlers.items():
            signal.signal(s, h)
    return subprocess.CompletedProcess([TRAIN, *args], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def warnings_to(stream):
    """Warnings as a script prints them on stderr (each one), not collected by pytest."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        stream.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))


def torchrun(nproc, *args, restarts=0, crash_at=None, **extra):
    """crash_at="ITER:RANK": that rank dies hard at that iteration on the first attempt
    (tests/crash_train.py)."""
    script = [os.path.join(ROOT, "tests", "crash_train.py"), crash_at] if crash_at else [TRAIN]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={nproc}", f"--max-restarts={restarts}", *script, *args],
                       capture_output=True, text=True, cwd=ROOT, env=env(**extra))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def load(out):
    return torch.load(os.path.join(out, "ckpt.pt"), map_location="cpu", weights_only=True)


def log(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_loss_falls_and_checkpoint_format(data, tmp_path, attention):
    out = str(tmp_path / "out")
    r = train(f"--data_dir={data}", f"--out_dir={out}", *TINY, f"--attention={attention}",
              "--max_iters=30", "--eval_interval=10", "--log_interval=5")
    evals = log(out)
    # Not on a terminal (a pipe here, like CI, SLURM or `> log`): one plain line per
    # log_interval instead of a bar's carriage-return updates, which wrote megabytes.
    assert "\r" not in r.stderr and "\r" not in r.stdout
    progress = [ln for ln in r.stdout.splitlines() if ln.startswith("iter ") and "/30:" in ln]
    assert [ln.split("/")[0] for ln in progress] == [f"iter {i}" for i in range(5, 31, 5)]
    assert all("loss" in ln and "eta" in ln for ln in progress)
    assert [r["iter"] for r in evals] == [0, 10, 20, 30]
    assert set(evals[0]) == {"iter", "train_loss", "val_loss", "lr", "tokens", "time_s"}
    assert evals[-1]["tokens"] == 30 * 4 * 32
    assert abs(evals[0]["val_loss"] - np.log(V)) < 0.3     # starts near uniform
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.7  # and clearly learns
    ck = load(out)
    assert ck["iter_num"] == 30 and ck["best_val_loss"] == min(r["val_loss"] for r in evals)
    assert ck["model_args"]["attention"] == attention and ck["model_args"]["vocab_size"] == V
    assert ck["config"]["max_iters"] == 30
    assert ck["tokenizer"]["sha256"] is None and ck["tokenizer"]["vocab_size"] == V
    assert not any(k.startswith("_orig_mod") for k in ck["model"])
    assert {"torch", "numpy", "python"} <= set(ck["rng"]) and ck["scaler"] is None
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def imported_by_run(*args):
    """The project modules a one-iteration run imported (`python -X importtime` lists each)."""
    r = subprocess.run([sys.executable, "-X", "importtime", TRAIN, *TINY, "--max_iters=1",
                        "--eval_iters=1", *args], capture_output=True, text=True, cwd=ROOT,
                       env=env())
    assert r.returncode == 0, r.stderr[-3000:]
    return {ln.split("|")[-1].strip() for ln in r.stderr.splitlines() if "|" in ln}


# module -> a flag whose path needs it (None: torchrun's): a plain one-process run
# never runs it, so never imports it (issue 36: the lines of project code a run imports)
OPTIONAL_MODULES = {"muon": "--optimizer=muon", "harness.torchrun_errors": None,
                    "baselines": "--pos_encoding=learned"}


def test_a_plain_run_imports_no_optional_module(data, tmp_path):
    plain = imported_by_run(f"--data_dir={data}", f"--out_dir={tmp_path / 'plain'}")
    assert "optim" in plain and not plain & set(OPTIONAL_MODULES)
    for module, flag in OPTIONAL_MODULES.items():  # and the path that needs one imports it
        assert importlib.util.find_spec(module)
        assert not flag or module in imported_by_run(f"--data_dir={data}",
                                                     f"--out_dir={tmp_path / module}", flag)


def test_a_split_of_exactly_block_size_plus_one_tokens_trains(tmp_path):
    """A window is T+1 tokens, so T+1 tokens hold exactly one, and that window is also the
    last one. The draw used to stop one window short (rng.integers(0, len-T-1) never returns
    the last start) and the check wanted T+2 tokens, so data/*/prepare.py's minimum
    validation split (1025 tokens) was refused at block_size 1024."""
    d = make_data(str(tmp_path / "data"))
    tok = np.fromfile(os.path.join(d, "val.bin"), dtype=np.uint16)
    tok[:33].tofile(os.path.join(d, "val.bin"))  # block_size 32 + 1
    out = str(tmp_path / "out")
    train(f"--data_dir={d}", f"--out_dir={out}", *TINY, "--max_iters=2", "--eval_interval=1")
    assert [r["iter"] for r in log(out)] == [0, 1, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA device")
def test_batches_pin_the_contiguous_window(data, tmp_path):
    """Pinning a strided view (w[:, :-1]) copies it through a pageable temporary first, so
    the transfer is neither pinned nor asynchronous. train.py must pin the whole contiguous
    window and slice it on the device. A CPU cannot pin, hence the skip; on a GPU this fails
    for the old code, which pinned x and y separately."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torch\n"
        "_pin = torch.Tensor.pin_memory\n"
        "def pin(self, *a, **k):\n"
        "    if not self.is_contiguous():\n"
        "        raise SystemExit('error: pinned a strided view')\n"
        "    return _pin(self, *a, **k)\n"
        "torch.Tensor.pin_memory = pin\n")
    train(f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", *TINY, "--device=cuda",
          "--max_iters=2", PYTHONPATH=str(site))


def test_tokenizer_identity_is_the_file_hash(tmp_path):
    """The checkpoint records the dataset's tokenizer by its sha256, and the run folder keeps
    the file itself (a later prepare into the dataset folder may replace it): written by a
    fresh run, and again by a resume that finds it missing."""
    d = make_data(str(tmp_path / "data"))
    blob = tokenizer_model(os.path.join(d, "tokenizer.model"), "the cat sat. a dog ran")
    out = str(tmp_path / "out")
    train(f"--data_dir={d}", f"--out_dir={out}", *TINY, "--max_iters=1")
    tok = load(out)["tokenizer"]
    assert tok["sha256"] == hashlib.sha256(blob).hexdigest()
    assert tok["path"] == os.path.abspath(os.path.join(d, "tokenizer.model"))
    assert tok["data_dir"] == d and tok["eos_id"] == 0 and tok["bos_id"] == 1
    kept = os.path.join(out, "tokenizer.model")
    assert open(kept, "rb").read() == blob
    os.remove(kept)
    train(f"--data_dir={d}", f"--out_dir={out}", *TINY, "--max_iters=2", "--init_from=resume")
    assert open(kept, "rb").read() == blob and load(out)["iter_num"] == 2


def test_a_truncated_tokenizer_is_one_line_before_training(tmp_path):
    """train.py used to train on it and record its hash; sample, eval and export then failed
    with sentencepiece's `RuntimeError: INTERNAL: could not parse ModelProto`."""
    d = make_data(str(tmp_path / "data"))
    path = os.path.join(d, "tokenizer.model")
    blob = tokenizer_model(path, "the cat sat. a dog ran")
    with open(path, "wb") as f:
        f.write(blob[:len(blob) // 2])
    out = str(tmp_path / "out")
    line = one_line_error(train(f"--data_dir={d}", f"--out_dir={out}", *TINY, "--max_iters=1",
                                check=False))
    assert "cannot load the tokenizer" in line and path in line
    assert not os.path.exists(out)


def test_the_checkpoint_records_the_data_folder_it_read(data, tmp_path):
    """eval.py --split and export.py find the run's data by this record: the folder as an
    absolute path, whatever form --data_dir took (here relative to train.py's working folder,
    which eval.py, run from elsewhere, would resolve against its own)."""
    out = str(tmp_path / "out")
    train(f"--data_dir={os.path.relpath(data, ROOT)}", f"--out_dir={out}", *TINY, "--max_iters=1")
    assert load(out)["config"]["data_dir"] == os.path.abspath(data)


def test_resume_is_exact(data, tmp_path):
    """12 iterations straight (evaluating every 3) == 6, stop, resume, 6 more (evaluating
    rarely): same weights and optimizer state. Dropout is on, so its RNG must resume too, and
    the different eval schedules show evaluation never touches the training stream."""
    common = [f"--data_dir={data}", *TINY, "--dropout=0.1", "--dtype=float32"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(*common, f"--out_dir={a}", "--max_iters=12", "--eval_interval=3")
    train(*common, f"--out_dir={b}", "--max_iters=6", "--eval_interval=100")
    assert load(b)["iter_num"] == 6
    train(*common, f"--out_dir={b}", "--max_iters=12", "--eval_interval=100",
          "--init_from=resume")
    ka, kb = load(a), load(b)
    assert kb["iter_num"] == 12
    assert max_diff(ka["model"], kb["model"]) < 1e-6
    sa, sb = ka["optimizer"]["state"], kb["optimizer"]["state"]
    assert max(max_diff(sa[i], sb[i]) for i in sa) < 1e-6
    # the final evaluation uses the same fixed batches in both runs
    assert abs(log(a)[-1]["val_loss"] - log(b)[-1]["val_loss"]) < 1e-6


def test_eval_interval_0_evaluates_and_saves_at_the_end_only(data, tmp_path):
    """--eval_interval=0 (config/speedrun_cpu.py): no evaluation at the start nor on the way,
    one at the end, and the same final weights and loss as a run evaluated every 2 iterations
    (the reference: evaluation never touches the training stream). A signal still saves, and
    the resumed run ends where the unbroken one does."""
    common = [f"--data_dir={data}", *TINY, "--dtype=float32", "--max_iters=8"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(*common, f"--out_dir={a}", "--eval_interval=2")
    train(*common, f"--out_dir={b}", "--eval_interval=0")
    assert [r["iter"] for r in log(a)] == [0, 2, 4, 6, 8]
    assert [r["iter"] for r in log(b)] == [8]
    assert max_diff(load(a)["model"], load(b)["model"]) < 1e-6
    assert abs(log(a)[-1]["val_loss"] - log(b)[-1]["val_loss"]) < 1e-6
    c = str(tmp_path / "c")
    train(*common[:-1], f"--out_dir={c}", "--eval_interval=0", "--max_iters=5")
    train(*common, f"--out_dir={c}", "--eval_interval=0", "--init_from=resume")
    assert [r["iter"] for r in log(c)] == [5, 8]
    assert max_diff(load(a)["model"], load(c)["model"]) < 1e-6
    r = train_here(f"--data_dir={data}", f"--out_dir={tmp_path / 'd'}", *TINY,
                   "--eval_interval=-1")
    assert r.returncode == 1 and "eval_interval must be >= 0, got -1" in r.stderr


def test_the_speedrun_config_trains_and_resumes_across_its_switch_exactly(data, tmp_path):
    """config/speedrun_cpu.py as docs/RECORDS.md runs it (shortened by flags after it): its
    model (QK-norm, the value residual), Muon, one evaluation at the end; stopped at iteration 3
    (before the switch to full windows at 4) and resumed, it ends where an unbroken run does."""
    common = ["config/speedrun_cpu.py", f"--data_dir={data}", "--dtype=float32",
              "--max_iters=6", "--lr_decay_iters=6", "--short_iters=4", "--warmup_iters=1"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(*common, f"--out_dir={a}")
    ck = load(a)
    assert ck["model_args"]["qk_norm"] and ck["model_args"]["value_residual"]
    assert ck["config"]["optimizer"] == "muon" and [r["iter"] for r in log(a)] == [6]
    assert log(a)[-1]["tokens"] == 4 * 12 * 32 + 2 * 12 * 64  # 4 short, 2 full
    train(*common[:4], "--max_iters=3", *common[5:], f"--out_dir={b}")
    train(*common, f"--out_dir={b}", "--init_from=resume")
    assert max_diff(ck["model"], load(b)["model"]) < 1e-6
    assert abs(log(a)[-1]["val_loss"] - log(b)[-1]["val_loss"]) < 1e-6


def test_flash_attention_is_off_only_for_short_bf16_windows_on_a_cpu(data, tmp_path):
    """harness/start.py turns SDPA's flash kernel off for bf16 training on a CPU at blocks
    <= 128 (bench/speed/attention.py --kernels: slower than math there) and nowhere else; torch's
    own flag, read when the process ends (a sitecustomize hook)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import atexit, torch\n"
        "atexit.register(lambda: print('flash', torch.backends.cuda.flash_sdp_enabled()))\n")
    seen = {}
    for dtype, block in (("bfloat16", 32), ("bfloat16", 256), ("float32", 32)):
        r = train(f"--data_dir={data}", f"--out_dir={tmp_path / f'{dtype}{block}'}", *TINY,
                  f"--block_size={block}", f"--dtype={dtype}", "--max_iters=0",
                  "--optimizer=adamw", PYTHONPATH=str(site))
        seen[dtype, block] = r.stdout.strip().splitlines()[-1]
    assert seen == {("bfloat16", 32): "flash False", ("bfloat16", 256): "flash True",
                    ("float32", 32): "flash True"}


def embedding_hook(tmp_path, env_var, text):
    """A sitecustomize folder (for PYTHONPATH) whose hook appends `text`, an expression of the
    token ids `idx`, to the file named by $env_var at every training forward's embedding."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, torch\n"
        "_forward = torch.nn.Embedding.forward\n"
        "def forward(self, idx):\n"
        "    if self.training:\n"
        f"        with open(os.environ['{env_var}'], 'a') as f:\n"
        f"            f.write({text})\n"
        "    return _forward(self, idx)\n"
        "torch.nn.Embedding.forward = forward\n")
    return site


def test_short_iters_draw_half_windows_first_and_resume_exactly(data, tmp_path):
    """--short_iters=N: the first N iterations draw windows of block_size // 2 tokens (as many
    windows), the rest full ones; tokens are counted as drawn (log.jsonl), and a run stopped
    before the switch and resumed after it ends where an unbroken one does. Reference: the token
    ids' shapes the embedding saw in training (a sitecustomize hook), and the count by hand."""
    site = embedding_hook(tmp_path, "SHAPES", "f'{tuple(idx.shape)}\\n'")
    common = [f"--data_dir={data}", *TINY, "--dtype=float32", "--short_iters=3",
              "--eval_interval=100"]
    a, b, shapes = str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "shapes.txt"
    train(*common, f"--out_dir={a}", "--max_iters=5", PYTHONPATH=str(site), SHAPES=str(shapes))
    assert shapes.read_text().splitlines() == ["(4, 16)"] * 3 + ["(4, 32)"] * 2
    assert log(a)[-1]["tokens"] == 4 * (16 * 3 + 32 * 2)
    train(*common, f"--out_dir={b}", "--max_iters=2")
    train(*common, f"--out_dir={b}", "--max_iters=5", "--init_from=resume")
    assert log(b)[-1]["tokens"] == log(a)[-1]["tokens"]
    assert max_diff(load(a)["model"], load(b)["model"]) < 1e-6


def test_doc_aligned_windows_start_at_an_end_of_document_and_resume_exactly(data, tmp_path):
    """--doc_aligned=True: every training window's first token is the dataset's eos_id (the
    tiny stream counts mod V, so eos_id 0 recurs, with noise tokens besides), where plain
    windows start anywhere; a run stopped and resumed ends where an unbroken one does.
    Reference: the token ids the embedding saw in training (a sitecustomize hook)."""
    site = embedding_hook(tmp_path, "FIRSTS", "' '.join(map(str, idx[:, 0].tolist())) + '\\n'")
    common = [f"--data_dir={data}", *TINY, "--dtype=float32", "--eval_interval=100"]
    firsts = {}
    for aligned in (True, False):
        path = tmp_path / f"firsts{aligned}.txt"
        train(*common, f"--out_dir={tmp_path / str(aligned)}", "--max_iters=6",
              f"--doc_aligned={aligned}", PYTHONPATH=str(site), FIRSTS=str(path))
        firsts[aligned] = [int(t) for t in path.read_text().split()]
    assert len(firsts[True]) == 6 * 4 and set(firsts[True]) == {0}
    assert len(set(firsts[False])) > 1
    a, b = str(tmp_path / "True"), str(tmp_path / "b")
    train(*common, f"--out_dir={b}", "--max_iters=3", "--doc_aligned=True")
    train(*common, f"--out_dir={b}", "--max_iters=6", "--doc_aligned=True", "--init_from=resume")
    assert max_diff(load(a)["model"], load(b)["model"]) < 1e-6


def test_doc_aligned_without_end_of_document_tokens_is_one_line(tmp_path):
    """A stream with no eos_id token has nowhere for an aligned window to start."""
    d = tmp_path / "noeos"
    d.mkdir()
    for split in ("train", "val"):
        (np.arange(2000) % (V - 1) + 1).astype(np.uint16).tofile(d / f"{split}.bin")
    (d / "meta.json").write_text(json.dumps({"name": "noeos", "vocab_size": V, "dtype": "uint16",
                                             "eos_id": 0, "bos_id": 1}))
    r = train_here(f"--data_dir={d}", f"--out_dir={tmp_path / 'out'}", *TINY, "--max_iters=2",
                   "--doc_aligned=True")
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: doc_aligned=True needs end-of-document tokens"), r.stderr


def test_resume_runs_this_commands_settings_and_records_what_ran(data, tmp_path):
    """Resuming with other optimizer settings must run them: load_state_dict used to bring
    back the checkpoint's weight_decay and betas while the new checkpoint's config claimed the
    new ones. Also: the recorded block_size is the model's (from the checkpoint), not the
    command line's, and log.jsonl's token count adds up across a change of batch size."""
    out = str(tmp_path / "out")
    common = [f"--data_dir={data}", f"--out_dir={out}", *TINY, "--dtype=float32",
              "--eval_interval=4"]
    train(*common, "--max_iters=4")
    train(*common, "--max_iters=6", "--init_from=resume", "--weight_decay=0.5", "--beta2=0.5",
          "--batch_size=8", "--block_size=16")
    ck = load(out)
    decay, no_decay = ck["optimizer"]["param_groups"]
    assert decay["weight_decay"] == 0.5 and no_decay["weight_decay"] == 0.0
    assert tuple(decay["betas"]) == tuple(no_decay["betas"]) == (0.9, 0.5)
    assert ck["config"]["block_size"] == ck["model_args"]["block_size"] == 32
    assert ck["config"]["batch_size"] == 8
    assert log(out)[-1]["iter"] == 6 and log(out)[-1]["tokens"] == 4 * 4 * 32 + 2 * 8 * 32
    assert ck["tokens"] == log(out)[-1]["tokens"]


def test_truncated_checkpoint_is_a_one_line_error(data, trained, tmp_path):
    out = str(tmp_path / "out")
    common = [f"--data_dir={data}", f"--out_dir={out}", *TINY]
    shutil.copytree(trained, out)  # a run of TINY, 2 iterations
    path = os.path.join(out, "ckpt.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    r = train_here(*common, "--max_iters=4", "--init_from=resume")
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("error: cannot load") and "ckpt.pt" in lines[0]


@pytest.mark.slow
def test_a_restart_never_resumes_another_runs_checkpoint(data, tmp_path):
    """out_dir holds an older run's checkpoint (another shape). A new torchrun job crashes
    before its first save and restarts: it must start its own run again, not resume the old
    one. The old checkpoint and log are moved aside, not deleted."""
    out = str(tmp_path / "out")
    train(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=2", "--n_embd=48")
    old = load(out)
    r = torchrun(1, f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=4",
                 "--eval_interval=2", restarts=1, crash_at="1:0")
    assert "resuming" not in r.stdout and "moved it to" in r.stdout
    new = load(out)
    assert new["model_args"]["n_embd"] == 32 and new["iter_num"] == 4
    assert new["run_id"] != old["run_id"]
    aside = glob.glob(os.path.join(out, "ckpt.*.pt"))
    assert len(aside) == 1 and max_diff(torch.load(aside[0], weights_only=True)["model"],
                                        old["model"]) == 0
    assert len(glob.glob(os.path.join(out, "log.*.jsonl"))) == 1
    assert [row["iter"] for row in log(out)] == [0, 2, 4]


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("one"))
    train(f"--data_dir={data}", f"--out_dir={out}", *DDP_ARGS)
    return out


DDP_ARGS = [*TINY, "--dropout=0.1", "--dtype=float32", "--gradient_accumulation_steps=2",
            "--max_iters=8", "--eval_interval=4"]


@pytest.mark.slow
def test_ddp_two_ranks_match_one_process(data, one_process, tmp_path):
    """torchrun with 2 gloo ranks and accumulation 2 == one process with accumulation 2: each
    rank runs global micro-step rank*1 + 0, and the gradient average is the same 1/G mean.
    (Not bit-equal: torchrun runs one thread per worker and all-reduce sums in another order.)"""
    out = str(tmp_path / "ddp")
    r = torchrun(2, f"--data_dir={data}", f"--out_dir={out}", *DDP_ARGS)
    ref, got = log(one_process), log(out)
    # (MFU per device, with tokens/s of all ranks: tests/test_runs.py; a CPU has no peak)
    assert "2 process(es)" in first_lines(r.stdout)[0]
    assert [r["iter"] for r in got] == [r["iter"] for r in ref] == [0, 4, 8]
    for r, g in zip(ref, got):
        assert abs(r["val_loss"] - g["val_loss"]) < 1e-5
        assert abs(r["train_loss"] - g["train_loss"]) < 1e-5
        assert r["tokens"] == g["tokens"]
    assert max_diff(load(one_process)["model"], load(out)["model"]) < 1e-5


@pytest.mark.slow
def test_torchrun_restart_resumes(data, one_process, tmp_path):
    """Rank 1 dies hard at iteration 5 (after the checkpoint at 4); torchrun --max-restarts=1
    restarts both ranks, they resume from the checkpoint and end where an unbroken run ends."""
    out = str(tmp_path / "restart")
    r = torchrun(2, f"--data_dir={data}", f"--out_dir={out}", *DDP_ARGS, restarts=1,
                 crash_at="5:1")
    assert "resuming from" in r.stdout + r.stderr
    assert load(out)["iter_num"] == 8
    assert [row["iter"] for row in log(out)] == [0, 4, 8]
    assert max_diff(load(one_process)["model"], load(out)["model"]) < 1e-5


def test_sigterm_saves_and_exits_zero(data, tmp_path):
    """After SIGTERM the run says what it saved, where, and the command that continues it
    (it used to say only `signal received: stopping at iteration 32`); that command resumes
    the same run: one run id printed, the checkpoint's, which the resumed run keeps (it
    printed the old id and a new one, which read as another run)."""
    out = str(tmp_path / "out")
    args = [f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=100000",
            "--eval_interval=100000"]
    p = subprocess.Popen([sys.executable, TRAIN, *args], cwd=ROOT, env=env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logf = os.path.join(out, "log.jsonl")
    deadline = time.time() + 60
    while time.time() < deadline and not (os.path.exists(logf) and os.path.getsize(logf)):
        time.sleep(0.2)  # the first evaluation is logged after the handlers are installed
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    stdout, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-2000:]
    ck = load(out)
    assert 0 < ck["iter_num"] < 100000
    assert log(out)[-1]["iter"] == ck["iter_num"]  # the final state was evaluated too
    saved = [ln for ln in stdout.splitlines() if ln.startswith("saved ")]
    assert len(saved) == 1, stdout
    head, _, command = saved[0].partition("; continue with ")
    assert head == f"saved {os.path.join(out, 'ckpt.pt')} (iteration {ck['iter_num']})"
    assert shlex.split(command) == ["python", TRAIN, *args, "--init_from=resume"]
    more = f"--max_iters={ck['iter_num'] + 2}"  # the printed command, stopping 2 steps later
    r = train(*shlex.split(command)[2:], more, OMP_NUM_THREADS="2")
    ids = set(re.findall(r"\brun ([0-9a-f]{8})\b", r.stdout))
    assert ids == {ck["run_id"][:8]}, r.stdout
    # and an OMP_NUM_THREADS the user set is the run's thread count, busy machine or not
    assert re.search(r", cpu \w+, 2 threads, ", first_lines(r.stdout)[0]), r.stdout
    assert load(out)["run_id"] == ck["run_id"] and load(out)["iter_num"] == ck["iter_num"] + 2


def test_sigterm_saves_before_evaluating(data, trained, tmp_path):
    """torchrun (and SLURM, Kubernetes) kill a worker some 30 s after SIGTERM, and a real
    evaluation can take longer than that, so the checkpoint must be written first. Here the
    evaluation is made long (20,000 batches) and the process is killed 8 s after SIGTERM, or
    as soon as the step it stopped at is on disk, which it must be by then."""
    out = str(tmp_path / "out")
    common = [f"--data_dir={data}", f"--out_dir={out}", *TINY, "--eval_interval=100000"]
    shutil.copytree(trained, out)  # a run of TINY, 2 iterations
    # resumed, so no evaluation runs at the start; one plain progress line per iteration
    p = subprocess.Popen([sys.executable, TRAIN, *common, "--max_iters=100000",
                          "--init_from=resume", "--eval_iters=20000", "--log_interval=1"],
                         cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # wait until training is under way
            if select.select([p.stdout], [], [], 1.0)[0] and p.stdout.readline().startswith(
                    "iter 5/"):
                break
        p.send_signal(signal.SIGTERM)
        deadline = time.time() + 8  # the grace period; the evaluation alone takes longer
        while time.time() < deadline and p.poll() is None and load(out)["iter_num"] < 5:
            time.sleep(0.2)  # (ckpt.pt is replaced atomically: always a whole checkpoint)
        p.kill()
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
        p.stdout.close()
    assert load(out)["iter_num"] >= 5


def test_nan_loss_keeps_last_checkpoint(data, trained, tmp_path):
    out = str(tmp_path / "out")
    common = [f"--data_dir={data}", f"--out_dir={out}", *TINY, "--dtype=float32"]
    shutil.copytree(trained, out)  # a run of TINY, 2 iterations
    with open(os.path.join(out, "ckpt.pt"), "rb") as f:
        before = hashlib.sha256(f.read()).hexdigest()
    # a learning rate of 1e30 blows the weights up on the first step, the loss on the next
    r = train(*common, "--max_iters=20", "--init_from=resume", "--learning_rate=1e30",
              "--warmup_iters=0", "--eval_interval=1000", check=False)
    assert r.returncode != 0
    assert "non-finite loss" in r.stderr.strip().splitlines()[-1]
    with open(os.path.join(out, "ckpt.pt"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == before


@pytest.mark.slow
def test_compile_trains_on_cpu(data, tmp_path):
    out = str(tmp_path / "out")
    # one layer: inductor's compilation, most of this test's time, grows with the graph
    train(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--compile=True", "--max_iters=20",
          "--eval_interval=20", "--dtype=float32", "--n_layer=1")
    evals = log(out)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3
    assert not any(k.startswith("_orig_mod") for k in load(out)["model"])


@pytest.mark.parametrize("args, message", [
    (["--n_layers=2"], "unknown config key 'n_layers' (did you mean 'n_layer'?)"),
    (["--batch_size=big"], "batch_size"),
    (["--dataset=nosuchcorpus"], "python data/text/prepare.py --input PATH "
                                 "--out_dir nosuchcorpus"),
    (["--dataset=shakespeare_char"], "python data/shakespeare/prepare.py --char"),
    (["--n_embd=30", "--n_head=4", "DATA"], "divisible"),
    (["--init_from=resume", "DATA"], "does not exist"),
    (["--short_iters=-1", "DATA"], "short_iters must be >= 0, got -1"),
])
def test_config_errors_are_one_line(args, message, data, tmp_path):
    args = [f"--data_dir={data}" if a == "DATA" else a for a in args]
    r = train_here(f"--out_dir={tmp_path}", *args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_the_build_hint_for_a_missing_dataset_is_a_command_that_builds_it(tmp_path):
    """The hint for dataset=text used to leave out the --input prepare requires, and never
    named the --data_dir folder train.py reads: run the hint as printed (PATH filled in, a
    vocabulary and split the tiny corpus allows) and train.py then trains on what it built."""
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    (tmp_path / "corpus").mkdir()
    for i in range(6):
        (tmp_path / "corpus" / f"{i}.txt").write_text(" ".join(rng.choice(words, 400)))
    d = str(tmp_path / "built")
    hint = one_line_error(train_here(f"--out_dir={tmp_path / 'out'}", "--dataset=text",
                                     f"--data_dir={d}"))
    cmd = shlex.split(hint.split("build it with: ", 1)[1])
    assert cmd[:2] == ["python", "data/text/prepare.py"] and "PATH" in cmd
    cmd = [sys.executable, cmd[1]] + [str(tmp_path / "corpus") if a == "PATH" else a
                                      for a in cmd[2:]]
    r = subprocess.run(cmd + ["--vocab_size", "300", "--min_val_tokens", "40"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    train("--dataset=text", f"--data_dir={d}", f"--out_dir={tmp_path / 'out'}", *TINY,
          "--max_iters=1")
    assert load(str(tmp_path / "out"))["tokenizer"]["path"] == os.path.join(d, "tokenizer.model")


def test_wandb_offline_records_the_run(data, tmp_path):
    out = str(tmp_path / "out")
    train(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=4", "--eval_interval=2",
          "--wandb_log=True", "--wandb_run_name=tiny", WANDB_MODE="offline",
          WANDB_SILENT="true", WANDB_DIR=out)
    runs = glob.glob(os.path.join(out, "wandb", "offline-run-*"))
    assert len(runs) == 1
    records = glob.glob(os.path.join(runs[0], "*.wandb"))
    assert len(records) == 1
    with open(records[0], "rb") as f:
        blob = f.read()
    # wandb's run file stores each history item as its key followed by the value as JSON
    # text: every evaluation of log.jsonl must be in it
    for row in log(out):
        assert json.dumps(row["val_loss"]).encode() in blob
    assert blob.count(b"val/loss") >= len(log(out))


# ----------------------------------------------------------------------------------------
# mistakes end in one line, before training starts, and leave nothing behind

def one_line_error(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    return lines[0]


def with_token_counts(d):
    """make_data's folder with the token counts prepare.py records in meta.json."""
    meta = json.load(open(os.path.join(d, "meta.json")))
    for split in ("train", "val"):
        meta[f"{split}_tokens"] = os.path.getsize(os.path.join(d, f"{split}.bin")) // 2
    json.dump(meta, open(os.path.join(d, "meta.json"), "w"))
    return d


@pytest.mark.parametrize("damage", ["truncated", "empty", "meta_not_json"])
def test_a_damaged_dataset_is_one_line_before_training(tmp_path, damage):
    """A train.bin cut short used to train on what was left (exit 0); an empty one or a
    meta.json that is not JSON ended in a traceback. Each is one line naming the file, and the
    out_dir the command would have made is not left behind."""
    d = with_token_counts(make_data(str(tmp_path / "data")))
    train_bin = os.path.join(d, "train.bin")
    size = os.path.getsize(train_bin)
    if damage == "truncated":
        with open(train_bin, "r+b") as f:
            f.truncate(size // 2)
    elif damage == "empty":
        open(train_bin, "w").close()
    else:
        with open(os.path.join(d, "meta.json"), "w") as f:
            f.write('{"vocab_size": 64, "dtype": ')
    out = tmp_path / "out"
    line = one_line_error(train_here(f"--data_dir={d}", f"--out_dir={out}", *TINY,
                                     "--max_iters=2"))
    if damage == "meta_not_json":
        assert "meta.json" in line and "JSON" in line
    else:
        assert "train.bin" in line
    if damage == "truncated":  # both sizes: the file's and the one meta.json implies
        assert f"{size // 2:,}" in line and f"{size:,}" in line, line
    assert not out.exists()


def test_token_ids_beyond_the_vocab_are_one_line(tmp_path):
    """A train.bin encoded with another (larger) tokenizer than meta.json says: the ids past the
    vocabulary used to end in an IndexError deep in the embedding."""
    d = make_data(str(tmp_path / "data"))
    tokens = np.fromfile(os.path.join(d, "train.bin"), dtype=np.uint16)
    tokens[::50] = V + 30  # in every window of 33 tokens
    tokens.tofile(os.path.join(d, "train.bin"))
    line = one_line_error(train_here(f"--data_dir={d}", f"--out_dir={tmp_path / 'out'}", *TINY,
                                     "--max_iters=2"))
    assert "train.bin" in line and str(V + 30) in line and f"vocab_size is {V}" in line


def test_a_meta_json_vocab_below_the_tokenizers_is_one_line_naming_both(tmp_path):
    """Issue 60 item 16: meta.json's vocab_size edited below the tokenizer's piece count read
    as "the data was encoded with another tokenizer" at the first batch. It is refused before
    training, naming meta.json's value, the tokenizer's count and the way back; a vocab_size
    above the count (padding) still trains."""
    d = make_data(str(tmp_path / "data"))
    path = os.path.join(d, "tokenizer.model")
    tokenizer_model(path, "the cat sat. a dog ran. " * 3)
    import sentencepiece as spm
    pieces = spm.SentencePieceProcessor(model_file=path).get_piece_size()
    meta = json.load(open(os.path.join(d, "meta.json")))
    json.dump(dict(meta, vocab_size=pieces - 1), open(os.path.join(d, "meta.json"), "w"))
    out = tmp_path / "out"
    line = one_line_error(train_here(f"--data_dir={d}", f"--out_dir={out}", *TINY,
                                     "--max_iters=1"))
    assert f"meta.json says vocab_size={pieces - 1}" in line and f"has {pieces} pieces" in line
    assert "prepare the dataset again" in line and "another tokenizer" not in line, line
    assert not out.exists()
    json.dump(dict(meta, vocab_size=V), open(os.path.join(d, "meta.json"), "w"))
    assert pieces <= V and train_here(f"--data_dir={d}", f"--out_dir={out}", *TINY,
                                      "--max_iters=1").returncode == 0


def test_compile_says_the_first_steps_wait_for_it_before_they_do(data, tmp_path, monkeypatch):
    """Issue 60 item 18: --compile=True on a CPU was 57 s without a line (the first forward
    compiles). The last line before the loop says why the wait and how to skip it, and a run
    without compile has no such line. torch.compile is the identity here: the line is what is
    tested, not the compiler (which needs a C++ compiler on a CPU, else the run says so and
    runs eager)."""
    from harness.device import cxx_compiler_found
    if not cxx_compiler_found():
        pytest.skip("no C++ compiler: compile=True runs eager here")
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)
    args = [f"--data_dir={data}", *TINY, "--max_iters=1", "--eval_interval=1"]
    r = train_here(*args, f"--out_dir={tmp_path / 'a'}", "--compile=True")
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stderr
    wait = "compile=True: the first evaluation and the first steps wait"
    said = [i for i, line in enumerate(lines) if line.startswith(wait)]
    first_eval = next(i for i, line in enumerate(lines) if line.startswith("iter 0:"))
    assert len(said) == 1 and said[0] < first_eval and "--compile=False" in lines[said[0]], lines
    quiet = train_here(*args, f"--out_dir={tmp_path / 'b'}")  # TINY has --compile=False
    assert quiet.returncode == 0 and "torch.compile" not in quiet.stdout, quiet.stdout


def test_a_failed_command_leaves_no_empty_out_dir(data, tmp_path):
    """End to end, as a user sees it (the other error tests run train.py in this process):
    the exit status, one line on stderr, and no folder left behind."""
    out = tmp_path / "new" / "out"
    line = one_line_error(train(f"--data_dir={data}", f"--out_dir={out}", *TINY,
                                "--n_embd=30", "--n_head=4", check=False))
    assert "divisible" in line and not out.exists()


@pytest.mark.parametrize("where", ["out_dir_under_a_file", "log_is_a_folder", "read_only"])
def test_an_out_dir_that_cannot_be_written_is_one_line_before_training(data, tmp_path, where):
    out = tmp_path / "out"
    if where == "out_dir_under_a_file":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "out"
    elif where == "log_is_a_folder":
        (out / "log.jsonl").mkdir(parents=True)
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes to read-only folders")
        out.mkdir()
        out.chmod(0o555)
    r = train_here(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=2")
    line = one_line_error(r)
    assert "cannot write" in line and str(tmp_path) in line
    assert "parameters" not in r.stdout  # nothing was built or trained


def test_a_config_file_that_raises_is_one_line_naming_the_file_and_line(data, tmp_path):
    conf = tmp_path / "conf.py"
    conf.write_text("batch_size = 4\nn_layer = 2\nn_head = undefined_name\n")
    line = one_line_error(train_here(str(conf), f"--data_dir={data}",
                                     f"--out_dir={tmp_path / 'o'}"))
    assert str(conf) in line and "line 3" in line and "undefined_name" in line


@pytest.mark.parametrize("content", [b"", b"this is a text file, not a checkpoint\n"])
def test_a_file_that_is_not_a_checkpoint_says_so_on_resume(data, tmp_path, content):
    """torch's own message for a 0-byte or non-zip file is a hint about
    _use_new_zipfile_serialization, which tells a user nothing."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(content)
    line = one_line_error(train_here(f"--data_dir={data}", f"--out_dir={out}", *TINY,
                                     "--init_from=resume"))
    assert "ckpt.pt" in line and "not a checkpoint" in line and "zipfile" not in line


def test_weights_that_do_not_fit_model_args_are_one_line_on_resume(data, trained, tmp_path):
    out = str(tmp_path / "out")
    common = [f"--data_dir={data}", f"--out_dir={out}", *TINY]
    shutil.copytree(trained, out)  # a run of TINY, 2 iterations
    ck = load(out)
    ck["model_args"] = dict(ck["model_args"], n_embd=48)
    torch.save(ck, os.path.join(out, "ckpt.pt"))
    line = one_line_error(train_here(*common, "--max_iters=4", "--init_from=resume"))
    assert "do not fit" in line and "ckpt.pt" in line


FULL_DISK = """
import errno, os, torch
_save = torch.save
calls = [0]
def save(obj, f, *a, **k):
    calls[0] += 1
    if calls[0] < int(os.environ["FULL_DISK_AT_SAVE"]):
        return _save(obj, f, *a, **k)
    f.write(b"PK partial bytes")  # the disk fills up halfway through
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
torch.save = save
"""


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(data, tmp_path):
    """The second save fails with ENOSPC: one line, the checkpoint of the first save stays
    (and still loads), and no temp file is left."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FULL_DISK)
    out = str(tmp_path / "out")
    r = train(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=4",
              "--eval_interval=2", check=False, PYTHONPATH=str(site), FULL_DISK_AT_SAVE="2")
    line = one_line_error(r)
    assert "No space left on device" in line and "ckpt.pt" in line
    assert load(out)["iter_num"] == 2
    assert sorted(os.listdir(out)) == [".train.lock", "ckpt.pt", "log.jsonl"]


FSYNC_TRACE = """
import os
_fsync, _replace = os.fsync, os.replace
def fsync(fd):
    path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
    with open(os.environ["FSYNC_TRACE"], "a") as f:
        f.write(f"fsync {os.path.realpath(path)}\\n")
    return _fsync(fd)
def replace(src, dst, *a, **k):
    with open(os.environ["FSYNC_TRACE"], "a") as f:
        f.write(f"replace {os.path.realpath(src)} {os.path.realpath(dst)}\\n")
    return _replace(src, dst, *a, **k)
os.fsync, os.replace = fsync, replace
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads fd paths from /proc")
def test_checkpoints_are_fsynced_before_the_rename_and_the_folder_after(data, tmp_path):
    """A rename survives a power loss only if the file's data was on disk before it and the
    folder's entry after it."""
    site, trace = tmp_path / "site", tmp_path / "trace.txt"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FSYNC_TRACE)
    out = os.path.realpath(str(tmp_path / "out"))
    train(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=2",
          "--eval_interval=1", PYTHONPATH=str(site), FSYNC_TRACE=str(trace))
    events = trace.read_text().splitlines()
    ckpt = os.path.join(out, "ckpt.pt")
    tmp = os.path.join(out, r".ckpt.pt.\d+.tmp")  # a name of the writing process's own
    renames = [i for i, e in enumerate(events) if re.fullmatch(f"replace {tmp} {ckpt}", e)]
    assert len(renames) == 2, events  # the saves at iterations 1 and 2
    start = 0
    for i in renames:
        written = events[i].split()[1]
        assert f"fsync {written}" in events[start:i], events  # the data, before the rename
        assert f"fsync {out}" in events[i + 1:], events  # the folder's entry, after it
        start = i + 1


def test_resume_without_the_config_file_checks_the_data_with_the_checkpoints_block_size(
        tmp_path):
    """A 100-token val split holds windows of the checkpoint's block_size 32; the check used
    the command's default block_size (256) and refused to resume."""
    d = make_data(str(tmp_path / "data"))
    np.fromfile(os.path.join(d, "val.bin"), dtype=np.uint16)[:100].tofile(
        os.path.join(d, "val.bin"))
    out = str(tmp_path / "out")
    train(f"--data_dir={d}", f"--out_dir={out}", *TINY, "--max_iters=2")
    train(f"--data_dir={d}", f"--out_dir={out}", "--init_from=resume", "--max_iters=3",
          "--compile=False", "--eval_iters=2", "--batch_size=4")
    assert load(out)["iter_num"] == 3 and load(out)["model_args"]["block_size"] == 32


def test_resuming_with_identical_flags_notes_no_change(data, trained, tmp_path):
    """vocab_size=0 means "from the dataset"; the checkpoint records the resolved 64, and the
    resume used to note "vocab_size changed"."""
    common = [f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", *TINY]
    shutil.copytree(trained, tmp_path / "out")  # made by `common`, 2 iterations
    r = train(*common, "--max_iters=4", "--init_from=resume")
    assert "changed" not in r.stdout, r.stdout


def test_wandb_resume_continues_the_same_run(data, tmp_path):
    """The resumed run logs to the wandb run the first one started (its id is in the
    checkpoint), not to a new one."""
    pytest.importorskip("wandb")
    out = str(tmp_path / "out")
    common = [f"--data_dir={data}", f"--out_dir={out}", *TINY, "--eval_interval=2",
              "--wandb_log=True"]
    wb = dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=out)
    train(*common, "--max_iters=2", **wb)
    first = load(out)["wandb_id"]
    train(*common, "--max_iters=4", "--init_from=resume", **wb)
    runs = sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*")))
    assert len(runs) == 2 and first
    assert all(r.endswith("-" + first) for r in runs), runs
    assert load(out)["wandb_id"] == first


@pytest.mark.parametrize("args, message", [
    (["--optimizer=sgd"], "optimizer must be 'adamw' or 'muon'"),
    (["--optimizer=muon", "--fsdp=True"], "optimizer=muon does not work with fsdp=True"),
    (["--optimizer=muon", "--dtype=float16"], "float16"),
])
def test_optimizer_choices_are_checked_in_one_line(data, tmp_path, args, message):
    line = one_line_error(train_here(f"--data_dir={data}", f"--out_dir={tmp_path / 'o'}", *TINY,
                                     *args))
    assert message in line
    if "--dtype=float16" in args and torch.cuda.is_available():
        assert "GradScaler" in line and "muon" in line


def test_train_defaults_are_roformer_config_defaults():
    """The model keys come from RoFormerConfig itself (declared once), except vocab_size,
    whose training default 0 means "from the dataset"."""
    import ast
    import dataclasses
    sys.path.insert(0, ROOT)
    from model import RoFormerConfig
    src = open(TRAIN).read()
    tree = ast.parse(src)
    assigned = []  # names the defaults section assigns (it ends where MODEL_KEYS is built)
    for node in tree.body:
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        if "MODEL_KEYS" in names:
            break
        assigned += names
    assigned = set(assigned)
    fields = {f.name for f in dataclasses.fields(RoFormerConfig)}
    assert assigned & fields == {"vocab_size"}  # no model key declared twice
    # the effective defaults, as recorded in a checkpoint's config, are RoFormerConfig's
    defaults = dataclasses.asdict(RoFormerConfig())
    assert (defaults["block_size"], defaults["n_layer"], defaults["n_head"],
            defaults["n_embd"]) == (256, 6, 6, 384)


def test_resuming_with_another_optimizer_is_one_line(data, trained, tmp_path):
    """AdamW's state cannot continue as Muon's (or back): say which optimizer the checkpoint
    holds instead of failing inside load_state_dict."""
    common = [f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", *TINY]
    shutil.copytree(trained, tmp_path / "out")  # made by `common`, 2 iterations
    line = one_line_error(train_here(*common, "--max_iters=4", "--init_from=resume",
                                     "--optimizer=muon"))
    assert "--optimizer=adamw" in line


# ----------------------------------------------------------------------------------------
# issue 28: values that make no sense, a zero rate, the log, resuming, torchrun

def tree(d):
    """Every file under d with its sha256: what "nothing on disk changed" compares."""
    out = {}
    for root, _, files in os.walk(d):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, d)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trained") / "out")
    train(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=2")
    return out


@pytest.mark.parametrize("args, message", [
    (["--max_iters=-3"], "max_iters must be >= 0"),
    (["--warmup_iters=-1"], "warmup_iters must be >= 0"),
    (["--learning_rate=-1e-3"], "learning_rate must be >= 0"),
    (["--min_lr=1e-2"], "min_lr (0.01) must not exceed learning_rate (0.003)"),
    (["--optimizer=muon", "--muon_momentum=1.0"], "muon_momentum must be in [0, 1)"),
    (["--optimizer=muon", "--muon_momentum=-0.5"], "muon_momentum must be in [0, 1)"),
    (["--beta2=1.0"], "beta2 must be in [0, 1)"),
    (["--cooldown=1.5"], "cooldown must be in [0, 1] (0: cosine)"),
    (["--seed=-1"], "seed must be from 0 to 2**64 - 1"),
    ([f"--seed={2 ** 64}"], "seed must be from 0 to 2**64 - 1"),
    (["--device=meta"], "device='meta' is not supported"),
    (["--rope_scaling=ntk", "--rope_factor=1e300"], "rope_factor=1e+300 is too large"),
])
def test_values_that_make_no_sense_are_one_line_and_change_nothing(trained, data, tmp_path, args,
                                                                   message):
    """--max_iters=-3 used to move the old checkpoint aside and write an iteration-0 one;
    min_lr above learning_rate made the rate rise while it "decayed"; a negative seed or
    muon_momentum >= 1 ended in a traceback. Each is one line, and the out_dir that holds a
    run is byte for byte as it was."""
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    before = tree(out)
    line = one_line_error(train_here(f"--data_dir={data}", f"--out_dir={out}", *TINY, *args))
    assert message in line
    assert tree(out) == before


def test_muon_with_a_zero_learning_rate_freezes_adamws_part_only(data, tmp_path):
    """learning_rate is AdamW's rate (embeddings, norms); Muon's is muon_lr. Muon's group rate
    used to be muon_lr / learning_rate times the schedule: a ZeroDivisionError at 0, which is a
    legitimate probe. The reference is the run's own initialisation (a run of 0 iterations
    with the same seed): AdamW's parameters must not move at all, Muon's must."""
    common = [f"--data_dir={data}", *TINY, "--optimizer=muon", "--dtype=float32"]
    init, probe = str(tmp_path / "init"), str(tmp_path / "probe")
    train(*common, f"--out_dir={init}", "--max_iters=0")
    train(*common, f"--out_dir={probe}", "--max_iters=3", "--learning_rate=0", "--min_lr=0")
    a, b = load(init)["model"], load(probe)["model"]
    muon = {k for k, v in a.items() if k.startswith("blocks.") and v.dim() == 2}
    assert muon and all(torch.equal(a[k], b[k]) for k in a if k not in muon)
    assert all(not torch.equal(a[k], b[k]) for k in muon)
    assert [row["lr"] for row in log(probe)] == [0.0, 0.0]


def test_a_torn_last_log_line_does_not_block_the_resume(data, trained, tmp_path):
    """A crash in the middle of a log write leaves half a line; the resume used to die on it
    with a JSONDecodeError. The log is not the run's state: the half line goes, with a warning,
    and the resumed run logs on. The resume also says which checkpoint and iteration it
    continues from, read here from the file itself."""
    out = str(tmp_path / "out")
    common = [f"--data_dir={data}", f"--out_dir={out}", *TINY, "--eval_interval=2"]
    shutil.copytree(trained, out)  # 2 iterations of TINY: evaluated at 0 and 2, as here
    with open(os.path.join(out, "log.jsonl"), "a") as f:
        f.write('{"iter": 4, "train_loss": 3.1')  # no end: the crash came here
    at = load(out)["iter_num"]
    r = train(*common, "--max_iters=4", "--init_from=resume")
    assert [row["iter"] for row in log(out)] == [0, 2, 4]
    assert "warning" in r.stdout and "log.jsonl" in r.stdout
    first = r.stdout.splitlines()[:3]
    assert any(f"resumed from {os.path.join(out, 'ckpt.pt')}: iteration {at}," in ln
               for ln in first), first


FULL_DISK_LOG = """
import builtins, errno, os
_open = builtins.open
writes = [0]
class Full:
    def __init__(self, f): self.f = f
    def __enter__(self): return self
    def __exit__(self, *a): self.f.close()
    def close(self): self.f.close()
    def write(self, text):
        writes[0] += 1
        if writes[0] != int(os.environ["FULL_DISK_AT_LOG"]):
            return self.f.write(text)
        self.f.write(text[:len(text) // 2])  # half the line made it, then the disk was full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
def fake_open(file, mode="r", *a, **k):
    f = _open(file, mode, *a, **k)
    return Full(f) if str(file).endswith("log.jsonl") and "a" in mode else f
builtins.open = fake_open
"""


def test_a_full_disk_while_logging_costs_a_warning_not_the_checkpoint(data, tmp_path):
    """The log write of the evaluation at iteration 2 fails half-way (ENOSPC). It used to be a
    traceback before that step's checkpoint was saved. Now: a warning, the run goes on and
    saves, and the log holds only whole lines (the half line was cut off again)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FULL_DISK_LOG)
    out = str(tmp_path / "out")
    r = train(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=4",
              "--eval_interval=2", PYTHONPATH=str(site), FULL_DISK_AT_LOG="2")
    warnings = [ln for ln in r.stdout.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "log.jsonl" in warnings[0] and "No space left" in warnings[0]
    assert load(out)["iter_num"] == 4
    assert [row["iter"] for row in log(out)] == [0, 4]  # every line parses; iteration 2 lost


def children(pid):
    """The pids whose parent is `pid`, from /proc."""
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            kids.append(int(entry))
    return kids


def running(pid):
    """Alive and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PDEATHSIG")
def test_killing_torchrun_stops_its_workers_and_the_resume_is_exact(data, tmp_path):
    """kill -9 of torchrun's process group used to leave both workers training on their own
    (torchrun starts them in sessions of their own). Now they get SIGTERM from the kernel when
    the launcher dies: they finish the step, save and exit within seconds. Resumed from that
    checkpoint, the run ends bit for bit where an unbroken 2-rank run ends."""
    out, ref = str(tmp_path / "out"), str(tmp_path / "ref")
    common = [f"--data_dir={data}", *DDP_ARGS, "--eval_interval=100000"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         TRAIN, *common, f"--out_dir={out}", "--max_iters=100000", "--log_interval=1"],
        cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    workers = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # wait until both ranks train
            if select.select([launcher.stdout], [], [], 1.0)[0]:
                line = launcher.stdout.readline()
                if line.startswith("iter 3/") or not line:
                    break
        workers = children(launcher.pid)
        assert len(workers) == 2, workers
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and its group
        launcher.wait()
        deadline = time.time() + 10
        while time.time() < deadline and any(running(w) for w in workers):
            time.sleep(0.1)
        assert not any(running(w) for w in workers), "the workers outlived their launcher"
    finally:
        for w in workers:
            if running(w):
                os.kill(w, signal.SIGKILL)
        tail = (launcher.stdout.read() + launcher.stderr.read())[-3000:]
        launcher.stdout.close()
        launcher.stderr.close()
    assert os.path.exists(os.path.join(out, "ckpt.pt")), f"no checkpoint after the kill:\n{tail}"
    stopped = load(out)["iter_num"]
    assert stopped >= 3
    torchrun(2, *common, f"--out_dir={out}", f"--max_iters={stopped + 2}", "--init_from=resume")
    torchrun(2, *common, f"--out_dir={ref}", f"--max_iters={stopped + 2}")
    a, b = load(ref), load(out)
    assert a["iter_num"] == b["iter_num"] == stopped + 2
    assert max_diff(a["model"], b["model"]) == 0
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert max(max_diff(sa[i], sb[i]) for i in sa) == 0


def readme_torchrun_lines():
    with open(os.path.join(ROOT, "README.md")) as f:
        return [ln.strip() for ln in f if ln.strip().startswith("torchrun ")]


@pytest.mark.slow
def test_the_readmes_cpu_torchrun_example_runs_as_written(data, tmp_path):
    """The README's torchrun example failed on a CPU with config/small.py (accumulation 1 on 2
    processes). Its config/small.py line runs here as written, made tiny by flags added after
    it (the data, the model's size, 2 iterations), and prints no per-rank FutureWarning
    (DDP's deprecated broadcast_buffers)."""
    import shlex
    line = [ln for ln in readme_torchrun_lines() if "config/small.py" in ln]
    assert len(line) == 1, readme_torchrun_lines()
    args = shlex.split(line[0])[1:]
    nproc = int([a for a in args if a.startswith("--nproc_per_node=")][0].split("=")[1])
    out = str(tmp_path / "out")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args,
                        f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=2"],
                       capture_output=True, text=True, cwd=ROOT, env=env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"{nproc} process(es)" in r.stdout and load(out)["iter_num"] == 2
    assert "FutureWarning" not in r.stderr and "broadcast_buffers" not in r.stderr, r.stderr


@pytest.mark.parametrize("late_rank", [None, 0])
def test_accumulation_that_the_processes_cannot_share_is_said_once(data, tmp_path, late_rank):
    """Accumulation 1 on 2 processes: the error used to be printed by every rank. It is said
    once, with the value to pass; nothing is trained or written. late_rank=0 starts rank 0 3 s
    late, as a busy host did: a rank 1 that left quietly at once got it killed before it spoke."""
    out = tmp_path / "out"
    script = TRAIN
    if late_rank is not None:
        script = tmp_path / "late.py"
        script.write_text(f"import os, runpy, sys, time\n"
                          f"time.sleep(3 * (os.environ['RANK'] == '{late_rank}'))\n"
                          f"sys.argv[0], sys.path[0] = {TRAIN!r}, {ROOT!r}\n"
                          f"runpy.run_path(sys.argv[0], run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", str(script), f"--data_dir={data}",
                        f"--out_dir={out}", *TINY, "--max_iters=2"],
                       capture_output=True, text=True, cwd=ROOT, env=env())
    assert r.returncode != 0
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if "gradient_accumulation" in ln]
    assert len(said) == 1 and said[0].startswith("error: "), said
    assert "multiple of 2" in said[0] and "--gradient_accumulation_steps=2" in said[0]
    assert not out.exists()


def test_a_mistake_every_rank_hits_is_said_once_without_a_rank_prefix(data, tmp_path):
    """A user error after the process group started was printed by every rank, each line
    prefixed by torch's "[rankN]: ". Now the one line, once, as a single process says it
    (the reference: the same command without torchrun). torchrun's own summary may follow."""
    args = [f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", *TINY, "--vocab_size=10",
            "--gradient_accumulation_steps=2"]
    alone = one_line_error(train(*args, check=False))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", TRAIN, *args],
                       capture_output=True, text=True, cwd=ROOT, env=env())
    assert r.returncode != 0
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if "vocab_size=10" in ln]
    assert said == [alone], r.stderr[-3000:]


@pytest.mark.skipif(sys.platform == "win32", reason="a PATH without a compiler, POSIX style")
def test_compile_without_a_cxx_compiler_falls_back_to_eager_in_one_warning(data, tmp_path):
    """--compile=True (train.py's default) on a CPU machine without a C++ compiler ended in
    inductor's traceback at the first forward. Here PATH holds no compiler and CXX is unset:
    one warning line, an eager run, and the checkpoint records compile=False (what ran)."""
    empty = tmp_path / "bin"
    empty.mkdir()
    out = str(tmp_path / "out")
    e = {"PATH": str(empty), "CXX": ""}
    r = subprocess.run([sys.executable, TRAIN, f"--data_dir={data}", f"--out_dir={out}", *TINY,
                        "--compile=True", "--max_iters=2", "--device=cpu"],
                       capture_output=True, text=True, cwd=ROOT,
                       env={k: v for k, v in env(**e).items() if v})
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [ln for ln in r.stdout.splitlines() if ln.startswith("warning:")]
    assert len(warned) == 1 and "C++ compiler" in warned[0], r.stdout
    assert load(out)["iter_num"] == 2 and load(out)["config"]["compile"] is False


def test_wandb_without_a_login_is_one_line_and_leaves_no_out_dir(data, tmp_path):
    """wandb_log=True with no API key anywhere (a fresh HOME, no WANDB_API_KEY, online mode)
    used to fail inside wandb.init after out_dir was made. It is one line before anything is
    written. The network is never reached: wandb's server points at a closed local port."""
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out"
    e = env(HOME=str(home), WANDB_CONFIG_DIR=str(home / "wandb"), WANDB_DIR=str(home),
            WANDB_BASE_URL="http://127.0.0.1:9", WANDB_SILENT="true")
    for k in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_IDENTITY_TOKEN_FILE"):
        e.pop(k, None)
    r = subprocess.run([sys.executable, TRAIN, f"--data_dir={data}", f"--out_dir={out}", *TINY,
                        "--max_iters=2", "--wandb_log=True"], capture_output=True, text=True,
                       cwd=ROOT, env=e, stdin=subprocess.DEVNULL, timeout=120)
    line = one_line_error(r)
    assert "wandb" in line and "login" in line
    assert not out.exists()


# ----------------------------------------------------------------------------------------
# init_from=RUN: a new run from another run's weights (fine-tuning, a longer window)

@pytest.fixture(scope="module")
def base_run(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("base") / "out")
    train(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=12", "--eval_interval=12")
    return out


def test_init_from_starts_a_new_run_from_the_weights_with_a_longer_window(data, base_run,
                                                                           tmp_path):
    """Iteration 0 of the new run holds RUN's weights exactly (max_iters=0 saves the start);
    it has its own id, a fresh optimizer and schedule, the window original * factor with the
    original context RUN's block_size; a continuation of the continuation keeps that original
    (extensions do not compound)."""
    base = load(base_run)
    start = str(tmp_path / "start")
    r = train(f"--data_dir={data}", f"--out_dir={start}", *TINY, f"--init_from={base_run}",
              "--block_size=128", "--rope_scaling=yarn", "--rope_factor=4", "--max_iters=0")
    ck = load(start)
    assert max_diff(ck["model"], base["model"]) == 0.0
    assert ck["iter_num"] == 0 and ck["run_id"] != base["run_id"]
    assert ck["config"]["init_from"] == os.path.abspath(base_run)
    args = ck["model_args"]
    assert (args["block_size"], args["rope_original"], args["rope_scaling"]) == (128, 32, "yarn")
    from model import RoFormerConfig
    assert RoFormerConfig(**args).context_window == 4 * 32
    assert "resumed" not in r.stdout
    # five steps: the optimizer's own step count, not RUN's 12 + 5; warmup from the start
    tuned = str(tmp_path / "tuned")
    train(f"--data_dir={data}", f"--out_dir={tuned}", *TINY, f"--init_from={base_run}",
          "--block_size=128", "--rope_scaling=yarn", "--rope_factor=4", "--max_iters=5",
          "--eval_interval=5")
    ck = load(tuned)
    steps = {int(s["step"]) for s in ck["optimizer"]["state"].values()}
    assert steps == {5} and ck["iter_num"] == 5
    assert log(tuned)[0]["lr"] == pytest.approx(3e-3 * 1 / 3)  # warmup_iters=2: (0+1)/(2+1)
    again = str(tmp_path / "again")
    train(f"--data_dir={data}", f"--out_dir={again}", *TINY, f"--init_from={tuned}",
          "--block_size=256", "--rope_scaling=yarn", "--rope_factor=8", "--max_iters=0")
    assert load(again)["model_args"]["rope_original"] == 32


def test_init_from_may_change_the_position_designs_and_keeps_runs_where_not_set(data, base_run,
                                                                                tmp_path):
    """Issue 38's fields add no weights: a fine-tune may set them (a window, a temperature for
    a longer context) on RUN's weights; one continuing that run without repeating them keeps
    RUN's (not the defaults: another model), and sets only what it names."""
    base, tuned, again = load(base_run), str(tmp_path / "tuned"), str(tmp_path / "again")
    train(f"--data_dir={data}", f"--out_dir={tuned}", *TINY, f"--init_from={base_run}",
          "--window=8", "--global_every=2", "--local_rope_base=500", "--length_temperature=0.2",
          "--rotary_fraction=0.5", "--nope_every=2", "--max_iters=0")
    ck = load(tuned)
    assert max_diff(ck["model"], base["model"]) == 0.0
    designs = dict(window=8, global_every=2, local_rope_base=500.0, length_temperature=0.2,
                   rotary_fraction=0.5, nope_every=2)
    assert {k: ck["model_args"][k] for k in designs} == designs
    train(f"--data_dir={data}", f"--out_dir={again}", *TINY, f"--init_from={tuned}",
          "--window=4", "--max_iters=0")
    assert load(again)["model_args"] == dict(ck["model_args"], window=4)


def test_init_from_keeps_runs_shape_keys_this_command_does_not_set(data, tmp_path):
    """A key of the model's shape that the continuation leaves unset is RUN's, not train.py's
    default: a p-RoPE run (rope_base 10) fine-tuned from config/small.py without --rope_base
    used to be refused (rope_base 10000 is not RUN's); set to another value, it still is."""
    run, tuned = str(tmp_path / "run"), str(tmp_path / "tuned")
    train(f"--data_dir={data}", f"--out_dir={run}", *TINY, "--rope_base=10",
          "--rotary_fraction=0.25", "--max_iters=2")
    train(f"--data_dir={data}", f"--out_dir={tuned}", *TINY, f"--init_from={run}",
          "--block_size=64", "--max_iters=0")
    assert load(tuned)["model_args"] == dict(load(run)["model_args"], block_size=64,
                                             rope_original=32)
    r = train_here(f"--data_dir={data}", *TINY, f"--out_dir={tmp_path / 'no'}",
                   f"--init_from={run}", "--rope_base=500", "--max_iters=0")
    assert r.returncode == 1 and "rope_base=500.0 but init_from" in r.stderr.strip(), r.stderr
    assert not os.path.exists(tmp_path / "no")


def test_init_from_refusals_are_one_line_and_leave_no_out_dir(data, base_run, tmp_path):
    """Everything init_from=RUN refuses is refused before out_dir exists: a shape key that is
    not RUN's (named), another tokenizer, RUN's own out_dir, a path with no checkpoint, learned
    positions asked to change block_size."""
    other_tok = str(tmp_path / "other_tok")
    shutil.copytree(data, other_tok)
    tokenizer_model(os.path.join(other_tok, "tokenizer.model"), "not the run's. tokenizer")
    cases = [([f"--data_dir={data}", "--n_embd=64"], "n_embd=64"),
             ([f"--data_dir={data}", "--attention=linear"], "attention="),
             ([f"--data_dir={other_tok}"], "another tokenizer"),
             ([f"--data_dir={data}", f"--init_from={tmp_path / 'nowhere'}"], "no such"),
             ([f"--data_dir={data}", "--pos_encoding=learned"], "pos_encoding=")]
    for i, (extra, words) in enumerate(cases):
        out = str(tmp_path / f"out{i}")
        r = train_here(*TINY, f"--out_dir={out}", f"--init_from={base_run}", *extra,
                       "--max_iters=2")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr
        assert words in lines[0], lines[0]
        assert not os.path.exists(out)
    before = load(base_run)["iter_num"]
    r = train_here(f"--data_dir={data}", *TINY, f"--out_dir={base_run}",
                   f"--init_from={base_run}", "--max_iters=2")
    assert r.returncode == 1 and "own out_dir" in r.stderr and load(base_run)["iter_num"] == before


def test_init_from_refuses_to_change_tie_embeddings_also_for_runs_from_before_the_key(
        data, base_run, tmp_path):
    """tie_embeddings changes which weights exist: init_from=RUN refuses another value in one
    line, also from a checkpoint written before the key existed (model_args without it: tied),
    which would otherwise load as an untied model with a copy of wte as its head."""
    ck = load(base_run)
    ck["model_args"] = {k: v for k, v in ck["model_args"].items() if k != "tie_embeddings"}
    ck["config"] = {k: v for k, v in ck["config"].items() if k != "tie_embeddings"}
    os.makedirs(tmp_path / "old")
    torch.save(ck, tmp_path / "old" / "ckpt.pt")
    out = str(tmp_path / "out")
    r = train_here(f"--data_dir={data}", *TINY, f"--out_dir={out}",
                   f"--init_from={tmp_path / 'old'}", "--tie_embeddings=False", "--max_iters=2")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "tie_embeddings=False" in lines[0] and "tie_embeddings=True" in lines[0], lines[0]
    assert not os.path.exists(out)


def extended(base_run, folder):
    """base_run's checkpoint as if it were a YaRN x4 extension to block_size 128 (RoPE has no
    weights, so the weights fit as they are)."""
    ck = load(base_run)
    ext = dict(block_size=128, rope_scaling="yarn", rope_factor=4.0, rope_original=32)
    ck["model_args"] = dict(ck["model_args"], **ext)
    ck["config"] = dict(ck["config"], **ext)
    os.makedirs(folder)
    torch.save(ck, os.path.join(folder, "ckpt.pt"))
    return folder


def test_a_continuation_keeps_runs_context_extension_unless_told(data, base_run, tmp_path):
    """--init_from=RUN of a YaRN run without repeating --rope_scaling/--rope_factor used to
    train with scaling off (a higher loss at iteration 0, same weights). It is the run that
    passes them explicitly: same model args, same loss at iteration 0; the first line says so."""
    ext = extended(base_run, str(tmp_path / "ext"))
    common = [f"--data_dir={data}", *TINY, f"--init_from={ext}", "--block_size=128",
              "--max_iters=0"]
    kept = train(*common, f"--out_dir={tmp_path / 'kept'}")
    train(*common, f"--out_dir={tmp_path / 'told'}", "--rope_scaling=yarn", "--rope_factor=4")
    a, b = load(str(tmp_path / "kept")), load(str(tmp_path / "told"))
    assert a["model_args"] == b["model_args"] and a["model_args"]["rope_scaling"] == "yarn"
    assert log(str(tmp_path / "kept"))[0]["val_loss"] == log(str(tmp_path / "told"))[0]["val_loss"]
    assert f"continuing from {ext}: rope_scaling yarn x4 (kept from RUN)" in kept.stdout


def test_the_continuations_scaling_flags_override_runs_one_by_one():
    """init_from=RUN: a scaling key given replaces RUN's, one not given is RUN's ("none" is
    factor 1), by sample.py's rule for the same flags."""
    sys.path.insert(0, ROOT)
    from harness.common import UserError
    from harness.resume import context_args
    theirs = dict(vocab_size=64, block_size=128, rope_scaling="yarn", rope_factor=4.0,
                  rope_original=32, pos_encoding="rope")
    mine = dict(theirs, vocab_size=0, rope_scaling="none", rope_factor=1.0, rope_original=0)

    def scaling(args, given):
        out = context_args(dict(args), theirs, set(given))
        return out["rope_scaling"], out["rope_factor"], out["rope_original"], out["vocab_size"]
    assert scaling(mine, []) == ("yarn", 4.0, 32, 64)
    assert scaling(mine, ["rope_scaling"]) == ("none", 1.0, 32, 64)
    assert scaling(dict(mine, rope_factor=8.0), ["rope_factor"]) == ("yarn", 8.0, 32, 64)
    assert scaling(dict(mine, rope_scaling="ntk"), ["rope_scaling"]) == ("ntk", 4.0, 32, 64)
    theirs.update(rope_scaling="none", rope_factor=1.0)
    with pytest.raises(UserError, match="rope_factor needs --rope_scaling"):
        scaling(dict(mine, rope_factor=4.0), ["rope_factor"])


@pytest.mark.parametrize("damage", ["nanogpt", "unknown_key"])
def test_a_checkpoint_train_cannot_start_from_is_one_line(base_run, tmp_path, damage):
    """A nanoGPT-shaped ckpt.pt (no "tokenizer") used to end in KeyError: 'tokenizer' on resume;
    model_args with a key this model.py lacks, in a TypeError. Both refused in one line by resume
    and by init_from=RUN alike."""
    sys.path.insert(0, ROOT)
    from harness import resume
    from harness.common import UserError
    base = load(base_run)
    ck = dict(base)
    if damage == "nanogpt":
        del ck["tokenizer"], ck["rng"], ck["run_id"]
        ck.pop("digest", None)  # nanoGPT writes none
    else:
        ck["model_args"] = dict(ck["model_args"], qk_gain=2.0)
    out = tmp_path / "out"
    out.mkdir()
    torch.save(ck, out / "ckpt.pt")
    words = "records no tokenizer" if damage == "nanogpt" else "model_args has qk_gain"
    with pytest.raises(UserError, match=words):
        resume.find(str(out), True, "run", 0, False)
    with pytest.raises(UserError, match=words):
        resume.continue_from(str(out), base["config"], list(base["model_args"]),
                             base["tokenizer"], str(tmp_path / "new"), set(), False)


def test_a_resume_with_nothing_to_train_says_so_and_writes_nothing(data, trained, tmp_path):
    """max_iters at (or below) the checkpoint's iteration used to exit 0 silently, having
    rewritten the checkpoint with this command's config."""
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    before = tree(out)
    r = train(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=2",
              "--init_from=resume")
    assert "the checkpoint is at iteration 2, max_iters=2: nothing to train" in r.stdout
    # the lock is any run's claim on the folder while it runs (its pid inside), not its state
    unlocked = lambda t: {k: v for k, v in t.items() if k != ".train.lock"}
    assert unlocked(tree(out)) == unlocked(before)


def first_lines(out):
    """The run's first line and its MFU line."""
    lines = out.splitlines()
    i = next(k for k, ln in enumerate(lines) if " parameters, " in ln)
    return lines[i], lines[i + 1]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_first_line_names_what_decides_speed_and_quality(data, tmp_path, optimizer):
    """It named no optimizer (`4.20M parameters, cpu bfloat16, compile=False, ...`) nor the
    threads. References: what the checkpoint records of the run (optimizer, device, dtype) and
    the threads torch computed with; the MFU line says once why a CPU has none, and no
    progress line shows one."""
    out = str(tmp_path / "out")
    r = train_here(f"--data_dir={data}", f"--out_dir={out}", *TINY, f"--optimizer={optimizer}",
                   "--max_iters=2", "--log_interval=1")
    assert r.returncode == 0, r.stderr
    first, mfu_line = first_lines(r.stdout)
    ran = load(out)["config"]
    threads = torch.get_num_threads()
    assert (f" parameters, {ran['device']} {ran['dtype']}, {threads} thread"
            f"{'s' * (threads > 1)}, optimizer={ran['optimizer']}, compile=False") in first, first
    assert ran["optimizer"] == optimizer
    assert mfu_line.startswith("MFU: n/a on a CPU") and "busy" in mfu_line
    assert "mfu" not in r.stdout.replace(mfu_line, "").lower()


def test_the_evaluation_before_iteration_0_shows_its_progress(data, tmp_path, monkeypatch):
    """Nothing was printed between `MFU: ...` and `iter 0: ...` while the first evaluation ran
    (55-153 s on a busy machine). Here every evaluation counts as long (QUIET_S 0): its
    countdown line comes between the two, with the batches it runs (no time left yet: the
    first batch alone carries the start-up, a compile where there is one)."""
    from harness import progress_waits
    monkeypatch.setattr(progress_waits, "QUIET_S", -1.0)
    r = train_here(f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", *TINY,
                   "--eval_iters=3", "--max_iters=0")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("MFU: "))
    assert lines[i + 2].startswith("iter 0: train"), lines
    assert re.fullmatch(r"evaluating iteration 0: 1/6 batches \(17%\), [\d:]+ so far",
                        lines[i + 1]), lines


def test_a_refusal_over_a_value_kept_from_init_from_says_so_and_what_to_pass(data, base_run,
                                                                           tmp_path):
    """--window=0 from a windowed RUN was refused over local_rope_base=100, a value the
    command never gave (RUN's, kept). The refusal says where it came from and which flag to
    pass; passing it then starts the run."""
    windowed, out = str(tmp_path / "windowed"), str(tmp_path / "out")
    train(f"--data_dir={data}", f"--out_dir={windowed}", *TINY, f"--init_from={base_run}",
          "--window=8", "--local_rope_base=100", "--max_iters=0")
    r = train_here(f"--data_dir={data}", f"--out_dir={out}", *TINY, f"--init_from={windowed}",
                   "--window=0", "--max_iters=0")
    line = one_line_error(r)
    assert f"local_rope_base=100.0 came from init_from={windowed}" in line, line
    flag = re.search(r"pass (--local_rope_base=\S+) as well", line).group(1)
    assert not os.path.exists(out)
    r = train_here(f"--data_dir={data}", f"--out_dir={out}", *TINY, f"--init_from={windowed}",
                   "--window=0", flag, "--max_iters=0")
    assert r.returncode == 0, r.stderr
    args = load(out)["model_args"]
    assert args["window"] == 0 and args["local_rope_base"] == 0


def test_the_hint_for_a_missing_data_dir_does_not_name_the_default_dataset(tmp_path):
    """--data_dir without --dataset: the folder's corpus is not data/pystdlib's, and the hint
    used to build the standard library's corpus into it."""
    d = str(tmp_path / "corpus")
    line = one_line_error(train(f"--out_dir={tmp_path / 'out'}", f"--data_dir={d}", *TINY,
                                check=False))
    assert "pystdlib" not in line
    assert f"python data/text/prepare.py --input PATH --out_dir {d}" in line


@pytest.mark.parametrize("cooldown", [0.0, 0.5])
def test_the_logged_rates_are_the_schedule_written_out(data, tmp_path, cooldown):
    """The rate at every logged iteration against the schedule written out by hand: warmup
    (it + 1) / (W + 1) of the peak, then cosine to min_lr at lr_decay_iters (cooldown=0, the
    default), or the peak held until the last `cooldown` share of the decay and a straight
    line to min_lr from there (the trapezoid docs/LOG.md compared), then min_lr."""
    import math
    out = str(tmp_path / "out")
    train(f"--data_dir={data}", f"--out_dir={out}", *TINY, "--max_iters=44",
          "--eval_interval=2", f"--cooldown={cooldown}")
    peak, floor, warm, end = 3e-3, 3e-4, 2, 40  # TINY's
    for record in log(out):
        it = record["iter"]
        if it < warm:
            want = peak * (it + 1) / (warm + 1)
        elif it >= end:
            want = floor
        elif cooldown == 0:
            want = floor + (peak - floor) * (1 + math.cos(math.pi * (it - warm) / (end - warm))) / 2
        else:
            start = end - cooldown * (end - warm)  # where the line down begins
            want = peak if it <= start else floor + (peak - floor) * (end - it) / (end - start)
        assert record["lr"] == pytest.approx(want, rel=1e-9, abs=1e-15), it


def test_garbage_collection_is_held_only_where_train_py_is_the_process(tmp_path):
    """harness/common.py's hold_collections (train.py, after its imports): in a process that
    runs the script itself, collections stop until release_collections (train.py, before its
    loop), which freezes what start-up made, and every object is frozen at exit; called inside a
    longer-lived process (these tests' runpy of train.py) it changes nothing."""
    import gc
    from harness import common
    common.hold_collections()  # from a function: not the process's top level
    common.release_collections()
    assert gc.isenabled() and not common.held
    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, gc, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from harness import common\n"
        "atexit.register(lambda: print(gc.get_freeze_count() - frozen > 4000))\n"  # after ours
        "common.hold_collections()\n"
        "print(gc.isenabled(), gc.get_freeze_count())\n"
        "common.release_collections()\n"
        "frozen = gc.get_freeze_count()\n"
        "print(gc.isenabled(), frozen > 1000)\n"
        "made = [[i] for i in range(5000)]\n")  # after release: frozen at exit only
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["False", "0", "True", "True", "True"], out.stdout + out.stderr
