"""train.py's harness, as units: the progress line (tokens/s over the wall time since the last
line, MFU against a datasheet peak only, a countdown for long evaluations), the CPU thread
count on a busy machine, and the memory check. References: a clock the tests move by hand,
the definitions (tokens / seconds, FLOP/s / peak), a real busy process, and a real model's
parameter count."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness import progress_waits  # noqa: E402
from harness import device as devices  # noqa: E402
from harness import mfu  # noqa: E402
from harness import progress_loop  # noqa: E402
from harness import memory  # noqa: E402
from harness.progress_loop import Progress  # noqa: E402


class Clock:
    """time.time for harness/progress_loop.py, moved by the test: seconds pass only when it says."""
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress_loop.time, "time", c)
    monkeypatch.setattr(progress_waits.time, "time", c)
    return c


def plain(p):
    p.interactive = False  # plain lines, whatever pytest's stderr is
    return p


def test_tokens_per_second_is_the_tokens_since_the_last_line_over_the_time_since_it(clock,
                                                                                   capsys):
    """tok/s was an average of single steps' rates: two identical pairs of runs gave 1.42x and
    1.12x. Reference: the definition, tokens trained since the last line over the wall time
    since it, evaluations and saves (paused) left out; steps of unequal length, so that an
    average of step rates differs from it; the first window's steps half as long in tokens (a
    run's short start, --short_iters), so the rate counts tokens, not iterations."""
    p = plain(Progress(0, 100, 1000, 1e6, None, 1, True))  # 1000 tokens before (a resume)
    steps = [0.1, 0.3, 2.0, 0.1, 0.5, 0.5, 1.2, 0.2, 0.1, 0.4]  # seconds per step
    with p.paused():
        clock.now += 50.0  # the evaluation at iteration 0
    rates, lines, tokens = [], [], 1000
    for it, window, tokens_per_iter in ((5, steps[:5], 50), (10, steps[5:], 100)):
        for k, dt in enumerate(window):
            clock.now += dt
            if k == 2:
                with p.paused():
                    clock.now += 30.0  # an evaluation and a save inside the window
        tokens += len(window) * tokens_per_iter
        p.log(it, tokens, 1.0, 1.0)
        rates.append(len(window) * tokens_per_iter / sum(window))
        lines.append(capsys.readouterr().out.strip())
    for line, want in zip(lines, rates):
        got = float(re.search(r"tok/s ([\d,]+)", line).group(1).replace(",", ""))
        assert got == pytest.approx(want, abs=0.5), (line, want)
        assert "mfu" not in line  # no peak (a CPU): the first lines said why, once


def test_with_compile_the_first_window_shows_no_rate(clock, capsys):
    """The first window holds the compilation: its rate would be a fraction of the run's."""
    p = plain(Progress(0, 100, 0, 1e6, None, 1, True, compiled=True))
    clock.now += 60.0
    p.log(1, 100, 1.0, 1.0)
    clock.now += 1.0
    p.log(2, 200, 1.0, 1.0)
    first, second = capsys.readouterr().out.strip().splitlines()
    assert "tok/s" not in first and "tok/s 100," in second + ",", (first, second)


def test_mfu_is_the_flops_of_one_device_over_its_peak_and_never_above_100_percent(clock, capsys):
    """MFU = model FLOP/s of one device / its peak, with tokens/s counting all ranks: a run
    doing 2x the peak prints no percentage, but n/a (the peak is wrong), from then on."""
    flops_per_token, tokens_per_iter, peak = 1e6, 100, 1e9
    for world in (1, 2):
        for doing, shown in ((0.5, "mfu 50.0%"), (2.0, "mfu n/a")):  # FLOP/s done / peak
            p = plain(Progress(0, 10, 0, flops_per_token, peak, world, True))
            dt = tokens_per_iter * flops_per_token / world / (doing * peak)  # a step's time
            capsys.readouterr()
            for it in range(1, 6):
                clock.now += dt
                p.log(it, it * tokens_per_iter, 1.0, 1.0)
            out = capsys.readouterr().out
            assert shown in out.splitlines()[-1], out
            assert "%" not in out.replace("100%", "").replace("50.0%", "")


def test_the_cpu_has_no_mfu_peak_however_busy_the_machine_is():
    """The timed CPU peak varied 0.0255-0.0671 TFLOP/s between runs, so slower runs showed the
    higher MFU. No peak at all on a CPU, in any dtype, with another process computing or
    not; a GPU the table lacks has none either."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert all(mfu.peak_flops("cpu", dtype) is None for dtype in ("float32", "bfloat16"))
    finally:
        hog.kill()
        hog.wait()
    assert mfu.peak_flops("cpu", "float32") is None and mfu.peak_flops("mps", "float32") is None


def seconds(interval):
    """tqdm's [h:]mm:ss as seconds."""
    value = 0
    for part in interval.split(":"):
        value = 60 * value + int(part)
    return value


def test_a_long_evaluation_says_how_long_it_has_left(clock, capsys):
    """The evaluation before iteration 0 ran 55-153 s on a busy machine with nothing printed.
    Without a terminal: one plain line once QUIET_S seconds have passed, with the time left
    (time per batch so far x batches left), then one every EVERY_S; a quick evaluation prints
    nothing, and neither does a rank other than 0."""
    q, every = progress_waits.QUIET_S, progress_waits.EVERY_S
    for per_batch, total, shown in ((0.01, 40, True), (1.0, 200, True), (1.0, 200, False)):
        c = (progress_waits.Lines(None, total, "evaluating iteration 0", "batches", out=sys.stdout)
             if shown else progress_waits.bar(total=total, shown=False))
        said = []
        for n in range(1, total + 1):
            clock.now += per_batch
            c.update()
            out = capsys.readouterr().out.strip()
            if out:
                said.append((n, out))
        c.close()
        if per_batch * total <= q or not shown:
            assert said == []
            continue
        first = math.ceil(q / per_batch)  # the batch that ends QUIET_S seconds
        assert said[0][0] == first
        # every line's estimate is the time per batch so far x the batches left, and they
        # come EVERY_S apart
        for n, line in said:
            left = re.search(r"about ([\d:]+) left", line).group(1)
            assert line.startswith(f"evaluating iteration 0: {n}/{total} batches")
            assert seconds(left) == pytest.approx(per_batch * (total - n), abs=1)
        assert [n for n, _ in said] == [first + int(every / per_batch) * k
                                        for k in range(len(said))]
        assert len(said) == 1 + int((total - first) * per_batch // every)


def waited(clock, capsys, total, steps, **kwargs):
    """progress_waits.Lines through `steps` [(seconds, items)] on the test's clock: (the seconds from
    the start each line was said at, that line), and the seconds the wait took."""
    start, said = clock.now, []
    c = progress_waits.Lines(None, total, "waiting", out=sys.stdout, **kwargs)
    for dt, n in steps:
        clock.now += dt
        c.update(n)
        line = capsys.readouterr().out.strip()
        if line:
            said.append((clock.now - start, line))
    return said, clock.now - start


@pytest.mark.parametrize("shape", ["prepare", "compiled evaluation"])
def test_a_long_wait_estimates_its_time_left_from_more_than_its_start_up(clock, capsys, shape):
    """Issue 60 item 18: the default corpus's prepare said "about 04:12 left" and ended 10 s
    later: its estimate rested on the first 5 kB of 31 MB, read before the worker processes
    were up. Waits of that shape (5 kB at once, a second of start-up, then 3 MB/s in 64 kB
    reads) and of train.py's first compiled evaluation (45 s for the first batch, then 0.05 s
    a batch; it said "about 02:17 left"): no line in the first QUIET_S seconds, and every time
    left said is within a factor 1.5 (and a second) of the time that was left."""
    if shape == "prepare":
        total, chunk = 31_500_000, 65_536
        steps = [(0.01, 5_000), (1.0, 0)] + [(chunk / 3e6, chunk)] * ((total - 5_000) // chunk)
        steps.append(((total - sum(n for _, n in steps)) / 3e6, total - sum(n for _, n in steps)))
    else:
        total, steps = 20, [(45.0, 1)] + [(0.05, 1)] * 19
    said, end = waited(clock, capsys, total, steps)
    assert said and said[0][0] >= progress_waits.QUIET_S, said
    for t, line in said:
        left = re.search(r"about ([\d:]+) left", line)
        if left:
            assert (end - t) / 1.5 - 1 <= seconds(left.group(1)) <= 1.5 * (end - t) + 1, \
                (line, end - t)
    if shape == "compiled evaluation":  # one line, at the first batch: no estimate from it
        assert said == [(45.0, "waiting: 1/20 it (5%), 00:45 so far")]


def test_a_busy_core_is_seen_and_gets_no_torch_thread(monkeypatch):
    """On a 2-core machine with one core busy, torch's second thread stalled a run 4.7x
    (docs/SPEED.md). A process computing is counted as busy (a real one, started here); the
    threads then leave the busy cores free, at least one; never more than torch's default;
    an OMP_NUM_THREADS the user set is kept as it is."""
    before = devices.busy_cores()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time
        time.sleep(0.3)  # running
        assert devices.busy_cores() >= 1
    finally:
        hog.kill()
        hog.wait()
    assert before is not None
    for cores in range(1, 9):
        for busy in range(0, 10):
            for default in range(1, 9):
                n = devices.fewer_threads(default, cores, busy)
                assert 1 <= n <= default
                assert n + busy <= cores or n == 1  # the busy cores are left free ...
                assert n in (default, 1, cores - busy)  # ... and no other core
    n0 = torch.get_num_threads()
    monkeypatch.setattr(devices, "busy_cores", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    n, note = devices.pick_threads("cpu")
    assert (n, set_to) == (1, [1]) and "OMP_NUM_THREADS=2" in note
    for env, dev in (({"OMP_NUM_THREADS": "2"}, "cpu"), ({}, "cuda"),
                     ({"LOCAL_WORLD_SIZE": "2"}, "cpu")):
        set_to.clear()
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert devices.pick_threads(dev) == (2, None) and set_to == []
    assert torch.get_num_threads() == 2 and n0 >= 1


def test_a_run_that_cannot_fit_in_memory_is_refused_before_allocating(monkeypatch):
    """--batch_size=1000000 and --n_layer=100000 ran into the allocator, or built layers for
    minutes. The estimate's weight terms are checked against a real model's parameter counts
    (built on the meta device: no memory), and the refusal against a machine of known RAM
    (sysconf faked to 8 GiB): what fits is let through, what cannot is one line in GiB that
    names what lowers the largest part: --vocab_size=100000000 (101 GiB at batch 1, block 8,
    one layer) was told to lower batch_size, block_size, n_layer or n_embd, never
    vocab_size."""
    from model import RoFormer, RoFormerConfig
    from harness.common import UserError
    cfg = RoFormerConfig(vocab_size=4096, block_size=256, n_layer=4, n_head=4, n_embd=256)
    with torch.device("meta"):
        model = RoFormer(cfg)
    real = sum(p.numel() for p in model.parameters())
    vocab = model.wte.weight.numel()
    parts = memory.training_memory(cfg, 0)  # no batch: the weights and their optimizer state
    assert abs(sum(n for *_, n in parts) - 16 * real) < 0.01 * 16 * real
    assert [n for _, keys, n in parts if keys == "vocab_size"] == [16 * vocab]
    total = lambda *a, **k: sum(n for *_, n in memory.training_memory(*a, **k))  # noqa: E731
    assert total(cfg, 16, checkpointing=True) < total(cfg, 16)
    pages = {"SC_PHYS_PAGES": 2 ** 21, "SC_PAGE_SIZE": 4096}  # 8 GiB
    monkeypatch.setattr(os, "sysconf", pages.__getitem__)
    cpu = torch.device("cpu")
    memory.check_fits(memory.training_memory(cfg, 16), cpu)  # config/small.py: fits
    big_vocab = dict(vocab_size=100_000_000, block_size=8, n_layer=1, n_embd=64)
    for changes, batch, lower, not_lower in (
            ({"n_layer": 4}, 1_000_000, "lower batch_size", "vocab_size"),
            ({"n_layer": 100_000}, 1, "lower n_layer or n_embd", "vocab_size"),
            (big_vocab, 1, "lower vocab_size", "batch_size")):
        c = RoFormerConfig(**{**vars(cfg), **changes})
        need = total(c, batch)
        with pytest.raises(UserError) as e:
            memory.check_fits(memory.training_memory(c, batch), cpu)
        message = str(e.value)
        assert f"about {need / 2 ** 30:,.1f} GiB per process, more than the 8.0 GiB of RAM" \
            in message and "\n" not in message
        assert lower in message and not_lower not in message, message
    # the vocabulary's part of that last one: its embedding, 16 bytes a weight, at the least
    with torch.device("meta"):
        wte = RoFormer(RoFormerConfig(**{**vars(cfg), **big_vocab})).wte.weight
    assert re.search(r"the embedding's weights and optimizer state take ([\d,.]+) GiB",
                     message)
    assert float(re.search(r"take ([\d,.]+) GiB", message).group(1).replace(",", "")) * 2 ** 30 \
        >= 16 * wte.numel() * 0.999
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: 4 ranks share the machine's RAM
    with pytest.raises(UserError, match="2.0 GiB of RAM per process"):
        memory.check_fits([("all", "batch_size", 3 * 2 ** 30)], cpu)


@pytest.mark.parametrize("batch,block", [(16, 100_000_000), (1_000_000_000, 256)])
def test_a_batch_too_large_names_batch_and_block_not_the_vocabulary(monkeypatch, batch, block):
    """Issue 60 item 16: --block_size=100000000 and --batch_size=1000000000 on a small model
    of vocab 512 were told to "lower vocab_size": the logits, which grow with batch_size x
    block_size, were counted in the vocabulary's part. The refusal names the part that is too
    large, the values of batch_size and block_size given and lowers them first."""
    from model import RoFormerConfig
    from harness.common import UserError
    pages = {"SC_PHYS_PAGES": 2 ** 21, "SC_PAGE_SIZE": 4096}  # 8 GiB
    monkeypatch.setattr(os, "sysconf", pages.__getitem__)
    cfg = RoFormerConfig(vocab_size=512, block_size=block, n_layer=2, n_head=2, n_embd=32)
    with pytest.raises(UserError) as e:
        memory.check_fits(memory.training_memory(cfg, batch), torch.device("cpu"))
    message = str(e.value)
    assert f"lower batch_size ({batch:,};" in message and f"block_size ({block:,})" in message
    assert "lower vocab_size" not in message and "\n" not in message, message
    logits = 8 * batch * block * 512  # float32 logits and their gradient
    shown = float(re.search(r"take ([\d,.]+) GiB", message).group(1).replace(",", ""))
    assert shown * 2 ** 30 == pytest.approx(logits, rel=1e-3), message
