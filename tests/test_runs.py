"""lib/mfu.py: the CPU peak that CPU MFU is measured against is timed by each run, kept in no
file, and, under DDP, by one rank and shared, since ranks timing at once on shared cores
each see a fraction of the machine. The references: a counter on the timing function, and the
value rank 0 measured.

Run as a script under torchrun (`python -m torch.distributed.run ... tests/test_runs.py OUT`),
this file is also the worker that records what each rank got."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from lib import mfu  # noqa: E402
from lib import run as runs  # noqa: E402
from lib.progress import Progress  # noqa: E402


def test_cpu_peak_is_timed_by_each_run_and_kept_in_no_file(tmp_path, monkeypatch):
    """The peak used to be cached in ~/.cache/roformer/cpu_peak.json, where a peak timed while
    the machine was busy stayed too low. Reference: a counter on the timing function, and the
    cache folder (XDG_CACHE_HOME), which must stay empty."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    timed = []

    def fake_matmul(dtype, seconds=0.2):
        timed.append(dtype)
        return 1e9 * len(timed)

    monkeypatch.setattr(mfu, "time_matmul", fake_matmul)
    assert mfu.cpu_peak_flops(torch.float32, ddp=False) == 1e9
    assert mfu.cpu_peak_flops(torch.float32, ddp=False) == 2e9  # timed again, never read back
    assert timed == [torch.float32] * 2 and not os.listdir(tmp_path)


def test_an_mfu_above_100_percent_is_na(monkeypatch, capsys):
    """A CPU peak timed while the machine was busy stayed cached and too low: every later run
    printed MFUs like 196.6%. The reference is the definition: MFU = FLOP/s done / peak, so a
    run doing 2x the peak must print no percentage, but n/a. A plausible MFU is still printed
    as computed."""
    monkeypatch.setattr(mfu, "time_matmul", lambda dtype: 1e9)
    peak = mfu.cpu_peak_flops(torch.float32, ddp=False)
    flops_per_token, tokens_per_iter = 1e6, 100
    for doing, shown in ((0.5, "mfu 50.0%"), (2.0, "mfu n/a")):  # FLOP/s done / peak
        p = Progress(0, 10, tokens_per_iter, flops_per_token, peak, 1, True)
        p.interactive = False  # plain lines, whatever pytest's stderr is
        dt = tokens_per_iter * flops_per_token / (doing * peak)
        capsys.readouterr()
        for it in range(1, 6):
            p.log(it, 1.0, 1.0, dt)
        out = capsys.readouterr().out
        assert shown in out.splitlines()[-1], out
    assert "%" not in out.replace("100%", "")  # no figure above 100 printed at any step


def test_a_run_that_cannot_fit_in_memory_is_refused_before_allocating(monkeypatch):
    """--batch_size=1000000 and --n_layer=100000 ran into the allocator, or built layers for
    minutes. The estimate's weight term is checked against a real model's parameter count
    (built on the meta device: no memory), and the refusal against a machine of known RAM
    (sysconf faked to 8 GiB): what fits is let through, what cannot is one line in GiB."""
    from model import RoFormer, RoFormerConfig
    from lib.common import UserError
    cfg = RoFormerConfig(vocab_size=4096, block_size=256, n_layer=4, n_head=4, n_embd=256)
    with torch.device("meta"):
        real = sum(p.numel() for p in RoFormer(cfg).parameters())
    assert abs(runs.training_memory(cfg, 0) - 16 * real) < 0.01 * 16 * real  # no batch
    assert runs.training_memory(cfg, 16, checkpointing=True) < runs.training_memory(cfg, 16)
    pages = {"SC_PHYS_PAGES": 2 ** 21, "SC_PAGE_SIZE": 4096}  # 8 GiB
    monkeypatch.setattr(os, "sysconf", pages.__getitem__)
    cpu = torch.device("cpu")
    runs.check_fits(runs.training_memory(cfg, 16), cpu)  # config/small.py: fits
    for batch, layers in ((1_000_000, 4), (16, 100_000)):
        need = runs.training_memory(RoFormerConfig(**{**vars(cfg), "n_layer": layers}), batch)
        with pytest.raises(UserError) as e:
            runs.check_fits(need, cpu)
        assert f"about {need / 2 ** 30:,.1f} GiB per process, more than the 8.0 GiB of RAM" \
            in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: 4 ranks share the machine's RAM
    with pytest.raises(UserError, match="2.0 GiB of RAM per process"):
        runs.check_fits(3 * 2 ** 30, cpu)


def test_the_real_probe_measures_a_plausible_rate(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    peak = mfu.cpu_peak_flops(torch.float32, ddp=False)
    assert 1e8 < peak < 1e14  # FLOP/s of one process on any CPU this runs on


def worker(out):
    """Under torchrun with an empty cache: every rank asks for the peak; the timing function
    answers with a rank-dependent rate and counts its calls."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, timed = dist.get_rank(), []

    def fake_matmul(dtype, seconds=0.2):
        timed.append(1)
        return 1e9 * (rank + 1)
    mfu.time_matmul = fake_matmul
    peak = mfu.cpu_peak_flops(torch.float32, ddp=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"peak": peak, "timed": len(timed)}, f)
    dist.destroy_process_group()


def test_cpu_peak_is_timed_by_one_rank_and_shared_under_ddp(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", os.path.abspath(__file__), str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    got = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    assert [g["peak"] for g in got] == [1e9, 1e9]  # rank 0's measurement, on both ranks
    assert sum(g["timed"] for g in got) == 1


if __name__ == "__main__":
    worker(sys.argv[1])
