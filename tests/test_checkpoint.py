"""harness/checkpoint.py, which writes checkpoints, and harness/load.py, which reads them
(`read`) and loads a run (`load_run`): its RoPE scaling overrides against a model built with
that scaling directly, files that are not checkpoints, a full disk during a save (simulated,
and real on a tiny tmpfs where one can be mounted), and the training device/dtype rules of harness/device.pick_device. A mistake is a UserError whose
message the scripts print as the one line `error: ...`."""
import errno
import hashlib
import io
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import harness.device  # noqa: E402
from harness import checkpoint, load  # noqa: E402
from harness.common import UserError  # noqa: E402
from harness.load import load_run  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402

ARGS = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([f"alpha beta gamma delta {i} epsilon zeta eta theta"
                                for i in range(200)]),
        model_writer=buf, model_type="bpe", vocab_size=64, hard_vocab_limit=False, unk_id=0,
        bos_id=-1, eos_id=1, pad_id=-1, minloglevel=2)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    return {"path": str(path), "sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
            "dataset": "tiny"}


def write_run(out, tokenizer, **model_args):
    """A run folder as train.py writes it, for a model with these arguments."""
    torch.manual_seed(0)
    model = RoFormer(RoFormerConfig(**dict(ARGS, **model_args)))
    os.makedirs(out, exist_ok=True)
    torch.save({"model": model.state_dict(), "model_args": model.config.__dict__,
                "tokenizer": tokenizer, "iter_num": 1, "best_val_loss": 1.0},
               os.path.join(out, "ckpt.pt"))
    return model


def logits(model, T=40):
    idx = torch.arange(T).remainder(64)[None]
    with torch.no_grad():
        return model(idx)[0]


def test_rope_scaling_none_switches_a_checkpoints_scaling_off(tmp_path, tokenizer):
    """--rope_scaling=none means factor 1: the model is the plain RoPE model with the same
    weights. It used to be refused, because the stored factor (4) stayed with 'none'."""
    out = str(tmp_path / "run")
    scaled = write_run(out, tokenizer, rope_scaling="ntk", rope_factor=4.0)
    model, _, _ = load_run(out, torch.device("cpu"), "float32", rope_scaling="none")
    assert model.config.rope_scaling == "none" and model.config.rope_factor == 1.0
    plain = RoFormer(RoFormerConfig(**ARGS))
    plain.load_state_dict(scaled.state_dict())
    plain.eval()
    assert torch.equal(logits(model), logits(plain))
    # the scaling was on: past a few positions the ntk angles differ (small, at random init)
    assert (logits(model) - logits(scaled.eval())).abs().max() > 1e-5
    # and the other way round: a scaling given at inference reaches the model
    model, _, _ = load_run(out, torch.device("cpu"), "float32", rope_scaling="linear",
                                      rope_factor=2.0)
    assert (model.config.rope_scaling, model.config.rope_factor) == ("linear", 2.0)


def test_rope_scaling_mistakes_are_one_line(tmp_path, tokenizer):
    rope, learned = str(tmp_path / "rope"), str(tmp_path / "learned")
    write_run(rope, tokenizer)
    write_run(learned, tokenizer, pos_encoding="learned")
    cpu = torch.device("cpu")
    for out, kwargs, words in [
        (rope, dict(rope_factor=4.0), "rope_factor needs --rope_scaling=linear"),
        (rope, dict(rope_scaling="none", rope_factor=4.0), "rope_factor needs"),
        (learned, dict(rope_scaling="ntk", rope_factor=2.0), "applies to RoPE models"),
    ]:
        with pytest.raises(UserError) as e:
            load_run(out, cpu, "float32", **kwargs)
        assert words in str(e.value), e.value
        assert "\n" not in str(e.value)
    # switching scaling off on a model that never had it is no mistake
    model, _, _ = load_run(learned, cpu, "float32", rope_scaling="none")
    assert model.config.rope_factor == 1.0


def test_tied_and_untied_runs_load_and_a_mismatch_is_one_line(tmp_path, tokenizer):
    """load_run (sample.py, eval.py, export.py) gives an untied run its own head and a tied run
    (also one written before tie_embeddings existed) its tie, each with the saved model's
    logits; model_args that say tied over an untied model's weights are one line, not wte
    silently overwritten by the head."""
    cpu = torch.device("cpu")
    for name, args in [("tied", {}), ("untied", dict(tie_embeddings=False))]:
        saved = write_run(str(tmp_path / name), tokenizer, **args).eval()
        model, _, _ = load_run(str(tmp_path / name), cpu, "float32")
        assert (model.lm_head.weight is model.wte.weight) == (name == "tied")
        assert torch.equal(logits(model), logits(saved))
    for name in ("tied", "untied"):  # model_args from before the key: tied
        ck = torch.load(tmp_path / name / "ckpt.pt", weights_only=True)
        old = {k: v for k, v in ck["model_args"].items() if k != "tie_embeddings"}
        os.makedirs(tmp_path / f"old_{name}")
        torch.save(dict(ck, model_args=old), tmp_path / f"old_{name}" / "ckpt.pt")
    model, _, _ = load_run(str(tmp_path / "old_tied"), cpu, "float32")
    assert model.lm_head.weight is model.wte.weight
    assert torch.equal(logits(model), logits(write_run(str(tmp_path / "tied"), tokenizer)))
    with pytest.raises(UserError) as e:
        load_run(str(tmp_path / "old_untied"), cpu, "float32")
    assert "tie_embeddings" in str(e.value) and "\n" not in str(e.value), e.value


def test_a_bad_rope_scaling_flag_is_blamed_on_the_flag(tmp_path, tokenizer):
    """The checkpoint's own config is fine, so a config the flags make invalid is their fault:
    the line names the flags, not ckpt.pt; and ntk at head dim 2 is that line, not a
    ZeroDivisionError."""
    rope, tiny_heads = str(tmp_path / "rope"), str(tmp_path / "tiny_heads")
    write_run(rope, tokenizer)
    write_run(tiny_heads, tokenizer, n_head=16)  # head dim 32 / 16 = 2
    for out, kwargs, words in [
        (rope, dict(rope_scaling="dynamic"), "--rope_scaling=dynamic"),
        (rope, dict(rope_scaling="linear", rope_factor=0.5), "--rope_factor=0.5"),
        (tiny_heads, dict(rope_scaling="ntk", rope_factor=2.0), "head dim 2 must be above 2"),
    ]:
        with pytest.raises(UserError) as e:
            load_run(out, torch.device("cpu"), "float32", **kwargs)
        msg = str(e.value)
        assert "\n" not in msg and words in msg, msg
        assert "ckpt.pt" not in msg and "--rope_scaling=" in msg
    # the checkpoint's own config at fault is still blamed on the checkpoint
    torch.save(dict(torch.load(os.path.join(rope, "ckpt.pt"), weights_only=True),
                    model_args=dict(ARGS, n_head=3)), os.path.join(rope, "ckpt.pt"))
    with pytest.raises(UserError) as e:
        load_run(rope, torch.device("cpu"), "float32", rope_scaling="ntk",
                            rope_factor=2.0)
    assert "model config in" in str(e.value) and "ckpt.pt" in str(e.value)


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all\n", "truncated"])
def test_a_file_that_is_not_a_checkpoint_says_so(tmp_path, tokenizer, content):
    """One loader for train.py's resume and load_run: a 0-byte, foreign or truncated ckpt.pt is
    "not a checkpoint", never torch's hint about _use_new_zipfile_serialization."""
    out = str(tmp_path / "run")
    write_run(out, tokenizer)
    path = os.path.join(out, "ckpt.pt")
    if content == "truncated":
        content = open(path, "rb").read()[:os.path.getsize(path) // 2]
    with open(path, "wb") as f:
        f.write(content)
    with pytest.raises(UserError) as e:
        load.read(path)
    assert "not a checkpoint" in str(e.value) and path in str(e.value)
    with pytest.raises(UserError) as e:
        load_run(out, torch.device("cpu"), "float32")
    msg = str(e.value)
    assert msg.startswith("cannot load") and "not a checkpoint" in msg, msg
    assert "zipfile" not in msg and "\n" not in msg


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """ENOSPC in the middle of torch.save: CheckpointError in one line, ckpt.pt still the
    previous one, no temp file."""
    path = str(tmp_path / "ckpt.pt")
    first = {"model": {"w": torch.ones(3)}, "model_args": {}, "iter_num": 1}
    checkpoint.commit(path, first)
    before = open(path, "rb").read()

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UserError) as e:
        checkpoint.commit(path, dict(first, iter_num=2))
    assert "No space left on device" in str(e.value) and "\n" not in str(e.value)
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_temp_names_are_the_processs_own_and_crashed_saves_are_cleaned(tmp_path, monkeypatch):
    """Two runs in one out_dir used to delete each other's temp (the fixed name ckpt.pt.tmp).
    The temp is named by the pid; what crashed saves left (any pid, the old fixed name, a DCP
    folder) goes once a save commits, and nothing else in the folder does."""
    path = str(tmp_path / "ckpt.pt")
    leftovers = [".ckpt.pt.99999999.tmp", "ckpt.pt.tmp", "ckpt-4.0.dcp.tmp"]
    for f in leftovers[:2]:
        (tmp_path / f).write_bytes(b"half")
    (tmp_path / leftovers[2]).mkdir()
    (tmp_path / "log.jsonl").write_text("{}\n")
    renamed = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(a), real(a, b)))
    checkpoint.commit(path, {"model": {"w": torch.ones(3)}, "model_args": {}})
    assert renamed == [str(tmp_path / f".ckpt.pt.{os.getpid()}.tmp")]
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "log.jsonl"]
    assert torch.equal(load.read(path)["model"]["w"], torch.ones(3))


HOLD_LOCK = """
import sys
sys.path.insert(0, {root!r})
from harness import out_dir
out_dir.prepare_out_dir({out!r})
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no fcntl: no lock")
def test_a_second_run_into_a_locked_out_dir_is_refused_until_the_first_dies(tmp_path):
    """Two runs into one out_dir interleaved their log.jsonl. While a process holds the folder
    a second is refused in one line naming the folder and the holder's pid, with nothing in
    it changed; once the holder is SIGKILLed (no clean-up ran) the folder is free again."""
    from harness import out_dir
    out = str(tmp_path / "out")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK.format(root=ROOT, out=out)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(UserError) as e:
            out_dir.prepare_out_dir(out)
        assert str(e.value).startswith(f"out_dir {out} is in use by another training run "
                                       f"(pid {holder.pid})")
        assert os.listdir(out) == [".train.lock"]
    finally:
        holder.kill()
        holder.wait()
    out_dir.prepare_out_dir(out)
    try:
        assert open(os.path.join(out, ".train.lock")).read() == f"{os.getpid()}\n"
    finally:
        os.close(out_dir.out_dir_lock.pop())


FILL_TMPFS = """
import os, sys, torch
sys.path.insert(0, {root!r})
from harness import checkpoint
from harness.common import UserError
path = os.path.join({mnt!r}, "ckpt.pt")
checkpoint.commit(path, {{"model": {{"w": torch.ones(1000)}}, "model_args": {{}}}})
try:
    checkpoint.commit(path, {{"model": {{"w": torch.ones(1_000_000)}}, "model_args": {{}}}})
except UserError as e:
    print(e)
"""


def test_a_real_full_disk_keeps_the_previous_checkpoint(tmp_path):
    """The same on a 1 MB tmpfs, where the second (4 MB) checkpoint cannot fit. Needs root and
    a kernel that lets this container mount tmpfs; skipped elsewhere."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs",
                                            str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        r = subprocess.run([sys.executable, "-c", FILL_TMPFS.format(root=ROOT, mnt=str(mnt))],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "No space left on device" in r.stdout
        assert os.listdir(mnt) == ["ckpt.pt"]
        ck = load.read(str(mnt / "ckpt.pt"))
        assert ck["model"]["w"].numel() == 1000
    finally:
        subprocess.run(["umount", str(mnt)])


def test_pick_device_rules_for_training_and_decoding(monkeypatch):
    """One resolver: training takes bf16 autocast on a CPU with native bf16 matmuls, decoding
    stays float32 on the CPU; float16 needs CUDA for training (its GradScaler)."""
    for native in (True, False):
        monkeypatch.setattr(harness.device, "cpu_has_bf16", lambda native=native: native)
        dev, dtype = harness.device.pick_device("cpu", "auto", training=True)
        assert dev.type == "cpu" and dtype == ("bfloat16" if native else "float32")
        assert harness.device.pick_device("cpu", "auto") == (torch.device("cpu"), "float32")
    with pytest.raises(UserError, match="float16 needs CUDA"):
        harness.device.pick_device("cpu", "float16", training=True)
    with pytest.raises(UserError, match="dtype must be"):
        harness.device.pick_device("cpu", "int8")
    with pytest.raises(UserError, match="unknown device"):
        harness.device.pick_device("gpu0")


def test_a_bare_cuda_is_placed_on_the_process_gpu(monkeypatch):
    """device=cuda (and auto on a GPU machine) stays a bare cuda in pick_device, so that each
    torchrun rank takes cuda:LOCAL_RANK (harness/parallel.py); one process takes cuda:0. train.py
    calls torch.cuda.set_device, which refuses a bare cuda: a one-GPU run stopped there before
    `placed` (seen on an H200). Checked without a GPU, torch's CUDA queries stubbed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for device in ("cuda", "auto"):
        for training in (True, False):
            dev, _ = harness.device.pick_device(device, "float32", training)
            assert dev == torch.device("cuda") and dev.index is None
            assert harness.device.placed(dev) == torch.device("cuda", 0)
            assert harness.device.placed(dev, 5) == torch.device("cuda", 5)
    named, _ = harness.device.pick_device("cuda:3", "float32")
    assert harness.device.placed(named, 5) == torch.device("cuda", 3)  # as the user named it
    assert harness.device.placed(torch.device("cpu"), 5) == torch.device("cpu")


def test_the_process_group_is_bound_to_the_process_gpu(monkeypatch):
    """Under torchrun on GPUs each rank joins NCCL bound to its own cuda:LOCAL_RANK (device_id:
    a barrier then needs no guess, and NCCL warned at every one); CPUs join gloo unbound.
    Checked without a GPU: the CUDA calls and the group's creation are stubbed, the rendezvous
    is a real in-memory store."""
    import torch.distributed as dist
    from harness import parallel
    joined = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    monkeypatch.setattr(dist, "rendezvous", lambda url: iter([(dist.HashStore(), 0, 1)]))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: joined.append(kw))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # init_process_group replaces it
    assert parallel.init_process_group(torch.device("cuda"), 2, 1, 4) == torch.device("cuda", 1)
    assert parallel.init_process_group(torch.device("cpu"), 2, 1, 4) == torch.device("cpu")
    assert [(kw["backend"], kw["device_id"], kw["rank"], kw["world_size"]) for kw in joined] == [
        ("nccl", torch.device("cuda", 1), 2, 4), ("gloo", None, 2, 4)]


@pytest.mark.parametrize("device", ["meta", "xpu", "mps", "cuda", "CUDA_PAST_THE_LAST"])
def test_a_device_that_is_not_here_is_one_line(device):
    """--device=mps or meta used to be taken on a machine without it and failed later with a
    traceback (meta holds no data at all). Whatever torch says is missing is one line, for
    training and decoding alike (sample.py and eval.py use the same resolver)."""
    if device == "CUDA_PAST_THE_LAST":
        device = f"cuda:{torch.cuda.device_count()}"
    here = {"meta": False, "xpu": False, "mps": torch.backends.mps.is_available(),
            "cuda": torch.cuda.is_available()}.get(device, False)
    for training in (True, False):
        if here:
            assert harness.device.pick_device(device, "float32", training)[0].type == device
            continue
        with pytest.raises(UserError) as e:
            harness.device.pick_device(device, "float32", training)
        msg = str(e.value)
        assert device in msg and "\n" not in msg
