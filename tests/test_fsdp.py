"""FSDP2 training (fsdp=True, harness/parallel.py) against independent references: one process and DDP
on the same global batch, an unbroken run for stop-and-resume, a one-process run resumed from
its own checkpoint for resharding 2 ranks -> 1, a normally built model for the meta-device
build, and the parameter counts themselves for the sharding. CPU, gloo, 2 ranks, tiny model.

Run as a script under torchrun (`python -m torch.distributed.run ... tests/test_fsdp.py OUT`),
this file is also the worker that reports what each rank holds."""
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import RoFormer, RoFormerConfig  # noqa: E402
from optim import build_optimizer  # noqa: E402
from test_train import (TINY, env, load, log, make_data, max_diff, torchrun, train,  # noqa: E402
                        train_here)

# clipping at 0.3 is active on every step here (the norm is ~0.8), so a norm that were not
# the global one would show in the losses
ARGS = [*TINY, "--dropout=0.1", "--dtype=float32", "--gradient_accumulation_steps=2",
        "--eval_interval=1", "--grad_clip=0.3"]
TOL = 1e-5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The counting corpus of test_train plus a 64-piece sentencepiece model (the corpus's
    vocabulary size), so that sample.py can turn any id into text."""
    spm = pytest.importorskip("sentencepiece")
    d = make_data(str(tmp_path_factory.mktemp("data")))
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([f"alpha beta gamma delta {i} epsilon zeta eta theta"
                                for i in range(200)]),
        model_writer=buf, model_type="bpe", vocab_size=64, hard_vocab_limit=False, unk_id=0,
        bos_id=-1, eos_id=1, pad_id=-1, minloglevel=2)
    with open(os.path.join(d, "tokenizer.model"), "wb") as f:
        f.write(buf.getvalue())
    assert spm.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model")) \
        .get_piece_size() == 64
    return d


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """Six iterations three ways (one process, DDP, FSDP), and FSDP stopped after three."""
    root = tmp_path_factory.mktemp("runs")
    out = {k: str(root / k) for k in ("one", "ddp", "fsdp", "fsdp3")}
    common = [f"--data_dir={data}", *ARGS]
    train(*common, f"--out_dir={out['one']}", "--max_iters=6")
    torchrun(2, *common, f"--out_dir={out['ddp']}", "--max_iters=6")
    torchrun(2, *common, f"--out_dir={out['fsdp']}", "--max_iters=6", "--fsdp=True")
    torchrun(2, *common, f"--out_dir={out['fsdp3']}", "--max_iters=3", "--fsdp=True")
    return out


def assert_same_losses(ref, got, iters):
    ref = {r["iter"]: r for r in log(ref)}
    got = {r["iter"]: r for r in log(got)}
    assert sorted(got) == sorted(ref) == list(iters)
    for i in iters:
        for k in ("train_loss", "val_loss"):
            assert abs(ref[i][k] - got[i][k]) < TOL, (i, k, ref[i][k], got[i][k])


def dcp_folders(out):
    return sorted(f for f in os.listdir(out) if ".dcp" in f)


@pytest.mark.slow
def test_fsdp_matches_one_process_and_ddp(runs):
    """Same global batch (accumulation 2 = 1 micro-step on each of 2 ranks): every evaluation
    over 6 steps and the final weights agree within 1e-5, and the consolidated ckpt.pt carries
    the same metadata as DDP's, with the optimizer in the DCP folder it names instead."""
    for other in ("ddp", "fsdp"):
        assert_same_losses(runs["one"], runs[other], range(7))
    one, ddp, fsdp = load(runs["one"]), load(runs["ddp"]), load(runs["fsdp"])
    assert max_diff(one["model"], fsdp["model"]) < TOL
    assert max_diff(ddp["model"], fsdp["model"]) < TOL
    assert set(fsdp) == set(ddp) - {"optimizer"} | {"sharded", "sharded_digest"}
    for k in ("iter_num", "model_args", "tokenizer"):
        assert fsdp[k] == ddp[k]
    assert abs(fsdp["best_val_loss"] - ddp["best_val_loss"]) < TOL
    assert fsdp["config"]["fsdp"] is True and fsdp["sharded"] in dcp_folders(runs["fsdp"])
    assert dcp_folders(runs["fsdp"]) == [fsdp["sharded"]]  # the older saves were removed


@pytest.mark.slow
def test_stop_and_resume_is_exact(runs, data, tmp_path):
    """3 steps, stop, resume from the DCP checkpoint for 3 more == 6 unbroken steps."""
    out = str(tmp_path / "resumed")
    shutil.copytree(runs["fsdp3"], out)
    assert load(out)["iter_num"] == 3
    torchrun(2, f"--data_dir={data}", *ARGS, f"--out_dir={out}",
             "--max_iters=6", "--fsdp=True", "--init_from=resume")
    assert_same_losses(runs["fsdp"], out, range(7))
    assert max_diff(load(runs["fsdp"])["model"], load(out)["model"]) < 1e-6
    assert dcp_folders(out) == [load(out)["sharded"]]


@pytest.mark.slow
def test_two_ranks_save_one_process_resumes(runs, data, tmp_path):
    """DCP reshards: the FSDP checkpoint of step 3, resumed by one plain process, continues
    exactly like a one-process run resumed from its own step-3 checkpoint: the same losses,
    weights, and AdamW state (moments and step count). And the other way round: that
    one-process checkpoint resumed by 2 FSDP ranks."""
    ref, out = str(tmp_path / "ref"), str(tmp_path / "from_fsdp")
    to_fsdp = str(tmp_path / "to_fsdp")
    common = [f"--data_dir={data}", *ARGS]
    train(*common, f"--out_dir={ref}", "--max_iters=3")
    shutil.copytree(ref, to_fsdp)
    train(*common, f"--out_dir={ref}", "--max_iters=6", "--init_from=resume")
    torchrun(2, *common, f"--out_dir={to_fsdp}", "--max_iters=6", "--init_from=resume",
             "--fsdp=True")
    assert_same_losses(ref, to_fsdp, range(7))
    assert max_diff(load(ref)["model"], load(to_fsdp)["model"]) < TOL
    shutil.copytree(runs["fsdp3"], out)
    train(*common, f"--out_dir={out}", "--max_iters=6", "--init_from=resume")
    assert_same_losses(ref, out, range(7))
    a, b = load(ref), load(out)
    assert a["iter_num"] == b["iter_num"] == 6
    assert max_diff(a["model"], b["model"]) < TOL
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(float(sb[i]["step"]) == 6 for i in sb)
    assert max(max_diff(sa[i], sb[i]) for i in sa) < TOL


@pytest.mark.slow
def test_sample_reads_an_fsdp_out_dir(runs, capsys):
    """sample.py on the FSDP run's out_dir, unchanged: the same text as on the DDP run's."""
    import sample as sample_py

    def sample(out):  # in this process, as tests/test_sample.py runs it
        capsys.readouterr()
        sample_py.main([f"--out_dir={out}", "--start=alpha", "--temperature=0",
                        "--max_new_tokens=40", "--stop_at_eos=False", "--device=cpu"])
        return capsys.readouterr().out
    text = sample(runs["fsdp"])
    assert len(text) > 40 and text == sample(runs["ddp"])


def test_activation_checkpointing_changes_nothing_but_memory(runs, data, tmp_path):
    """Recomputing the blocks in backward (dropout included: its RNG state is replayed) gives
    the losses of the plain run."""
    out = str(tmp_path / "ac")
    train(f"--data_dir={data}", *ARGS, f"--out_dir={out}", "--max_iters=6",
          "--activation_checkpointing=True")
    assert_same_losses(runs["one"], out, range(7))
    assert max_diff(load(runs["one"])["model"], load(out)["model"]) < 1e-6


@pytest.mark.parametrize("pos_encoding,tied", [("rope", True), ("sinusoidal", True),
                                               ("learned", True), ("none", True),
                                               ("rope", False)])
@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_meta_build_equals_a_normal_build(pos_encoding, tied, attention):
    """build.build_model (meta device, to_empty, init) against RoFormer(cfg) built the usual
    way: the same buffers (position tables) exactly, the head tied to the embedding as the
    config says, and every parameter (an untied head too) drawn by model.py's rule: constants
    equal, random ones with the same spread (model.py draws them in another order)."""
    from harness import build
    cfg = RoFormerConfig(vocab_size=256, block_size=64, n_layer=3, n_head=4, n_embd=64,
                         pos_encoding=pos_encoding, attention=attention, bias=True,
                         tie_embeddings=tied)
    torch.manual_seed(0)
    ref = RoFormer(cfg)
    got, _, _ = build.build_model(cfg, 1337, "cpu")
    rb, gb = dict(ref.named_buffers()), dict(got.named_buffers())
    assert rb.keys() == gb.keys()
    for k in rb:
        assert gb[k].dtype == rb[k].dtype and torch.equal(gb[k], rb[k]), k
    assert (got.lm_head.weight is got.wte.weight) == tied
    rp, gp = dict(ref.named_parameters()), dict(got.named_parameters())
    assert rp.keys() == gp.keys()
    for k in rp:
        r, g = rp[k].detach(), gp[k].detach()
        if r.std() == 0:
            assert torch.equal(r, g), k
        else:
            assert abs(g.std() / r.std() - 1) < 0.1, k
            assert abs(g.mean()) < 4 * r.std() / r.numel() ** 0.5, k
    # the weights depend on the seed only
    again, _, _ = build.build_model(cfg, 1337, "cpu")
    assert max_diff(got.state_dict(), again.state_dict()) == 0


def untied_or(pe):
    return RoFormerConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32,
                          pos_encoding="rope" if pe == "untied" else pe,
                          tie_embeddings=pe != "untied")


def worker(out):
    """Under torchrun: build the FSDP model for a few position encodings; record this rank's
    local parameter and AdamW-state sizes after a step, and (rank 0) the consolidated initial
    weights and the buffers."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from harness import build
    dist.init_process_group("gloo")
    rank, res = dist.get_rank(), {}
    for pe in ("rope", "sinusoidal", "learned", "untied"):  # untied: rope, tie_embeddings=False
        cfg = untied_or(pe)
        raw, model, _ = build.build_model(cfg, 1337, "cpu", fsdp=True)
        full = get_model_state_dict(raw, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
        opt = build_optimizer(raw, 1e-3, 0.1)
        x = torch.from_numpy(np.random.default_rng(0).integers(0, 64, (2, 32)))
        model(x, x)[1].backward()
        opt.step()
        res[pe] = {"params": sum(p.to_local().numel() for p in raw.parameters()),
                   "opt": sum(v.to_local().numel() for s in opt.state.values()
                              for v in s.values() if v.dim()),
                   "total": sum(p.numel() for p in raw.parameters()),
                   "weights": full, "buffers": dict(raw.named_buffers()),
                   "tied": (raw.lm_head.weight is raw.wte.weight) == cfg.tie_embeddings}
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_each_rank_holds_half_and_the_weights_of_one_process(tmp_path):
    """Two ranks: each holds about half of the parameters and of the AdamW moments (their sum
    is the whole model, exactly), and the sharded initialisation gathers to the weights that
    one process draws; the meta-device buffers equal a normally built model's."""
    from harness import build
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", os.path.abspath(__file__), str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, env=env())
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt", weights_only=True) for i in range(2)]
    for pe, rec in ranks[0].items():
        total = rec["total"]
        assert sum(rk[pe]["params"] for rk in ranks) == total
        assert sum(rk[pe]["opt"] for rk in ranks) == 2 * total  # exp_avg and exp_avg_sq
        for rk in ranks:
            assert abs(rk[pe]["params"] / total - 0.5) < 0.05 and rk[pe]["tied"]
        cfg = untied_or(pe)
        one, _, _ = build.build_model(cfg, 1337, "cpu")
        assert max_diff(one.state_dict(), rec["weights"]) == 0
        normal = dict(RoFormer(cfg).named_buffers())
        assert rec["buffers"].keys() == normal.keys()
        assert all(torch.equal(rec["buffers"][k], normal[k]) for k in normal)


def test_fsdp_needs_torchrun(data, tmp_path):
    r = train_here(f"--data_dir={data}", f"--out_dir={tmp_path}", *TINY, "--fsdp=True")
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: fsdp=True")


if __name__ == "__main__":
    worker(sys.argv[1])


@pytest.mark.slow
def test_init_from_an_fsdp_run_and_into_one(runs, data, tmp_path):
    """init_from=RUN reads an FSDP run (its ckpt.pt's consolidated weights, the DCP folder
    beside it) in one process, and loads a one-process run's weights into an FSDP run's
    shards: iteration 0 of each new run holds exactly the weights it started from."""
    common = [f"--data_dir={data}", *ARGS, "--max_iters=0", "--block_size=64",
              "--rope_scaling=linear", "--rope_factor=2"]
    one = str(tmp_path / "from_fsdp")
    train(*common, f"--out_dir={one}", f"--init_from={runs['fsdp']}")
    assert max_diff(load(one)["model"], load(runs["fsdp"])["model"]) == 0.0
    sharded = str(tmp_path / "into_fsdp")
    torchrun(2, *common, f"--out_dir={sharded}", f"--init_from={runs['one']}", "--fsdp=True")
    ck = load(sharded)
    assert "sharded" in ck and ck["iter_num"] == 0 and ck["model_args"]["rope_original"] == 32
    assert max_diff(ck["model"], load(runs["one"])["model"]) == 0.0
