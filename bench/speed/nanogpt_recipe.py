"""nanoGPT's CPU recipe as the reference bench/speed/train_speed.py measures against: its shape
(RECIPE), the nanoGPT-equivalent model (recipe_model("learned")), torch's AdamW as nanoGPT
builds it (plain_optimizer), the plain loop (plain_steps), the whole plain command with its
evaluations and checkpoint writes (plain_run, train_speed.py --plain_run=DIR), and
train_speed.py --target's race to nanoGPT's final loss (target).

--target=True: quality per unit of time. nanoGPT's shakespeare_char CPU recipe (RECIPE's
shape, dropout 0, --target_iters=2000 iterations, lr 1e-3 warmed up over 100 and cosine-decayed
to 1e-4 at 2000, betas 0.9/0.99, weight decay 0.1, clip 1.0) on a character-level text
(--text: a file, or a folder's .txt files in name order, cut to --text_chars characters; its
first 90% trains, the last 10% is held out, as nanoGPT splits). The nanoGPT-equivalent model
with AdamW ("nanoGPT" below), and our RoFormer (RoPE) with Muon (--muon_lr; AdamW at the
recipe's rate for the rest) and with AdamW, from the same seed and the same batches. They
alternate in chunks of --target_eval iterations (so the shared machine's load hits all alike),
each chunk timed, then scored on the same --target_batches held-out batches. The target is
nanoGPT's final held-out loss; the table gives the first scored iteration at which each run
reaches it, the training time (scoring excluded) taken to get there, nanoGPT's time over the
same iterations, and the time to the target as a fraction of nanoGPT's whole run: (ours /
nanoGPT's, same iterations, same load) x iteration / --target_iters, so a load that drifts
during the run does not bias it. --ours_iters=N (default 0: nanoGPT's schedule) gives our two
runs a schedule of their own, as the recipe allows: N iterations, warmup --ours_warmup, then
cosine, or with --ours_cooldown=F train.py's trapezoid (the peak held, then linear to lr/10
over the last F of the decay), and --ours_lr its AdamW rate (default the recipe's; with Muon,
the rate of the embeddings, head and norms); --ours_qk_norm=True builds our model with
qk_norm (model.py: q and k at mean 0, RMS 1; exports to HF only); --ours_dtype (default auto:
as train.py picks, bf16 autocast on a CPU that multiplies bf16 natively, else float32) the dtype
our two runs train and are scored in; --ours_short=N: our runs' first N iterations train on
windows of --ours_short_block tokens (default 32) instead of the block's 64, as many windows
(a sequence-length schedule: fewer tokens per early step; RoPE leaves no position untrained by
it, and the scored batches keep the full block). nanoGPT's run keeps its recipe (float32: its
train.py runs a CPU without autocast), and sets the target.
"""
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

from model import RoFormer, RoFormerConfig  # the importer puts the repo root on sys.path
from harness.common import UserError
from harness.device import native_bf16, pick_device
from optim import build_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, vocab_size=65)
LR, WEIGHT_DECAY, BETAS, WARMUP = 1e-3, 0.1, (0.9, 0.99), 100


def recipe_model(pos, vocab_size=RECIPE["vocab_size"], **options):
    """nanoGPT's CPU shape as our RoFormer. pos="learned" is the nanoGPT-equivalent model:
    learned positions, pre-LayerNorm blocks without biases, causal SDPA, GELU MLP, tied head.
    options: other RoFormerConfig fields (the race's --ours_qk_norm)."""
    shape = dict(RECIPE, vocab_size=vocab_size)
    del shape["batch_size"]
    return RoFormer(RoFormerConfig(pos_encoding=pos, bias=False, dropout=0.0, **shape, **options))


def plain_model(pos):
    torch.manual_seed(1337)
    return recipe_model(pos)


def plain_optimizer(model):
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                               "weight_decay": WEIGHT_DECAY},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=LR, betas=BETAS)


def plain_batch(data_dir, split, gen):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    T = RECIPE["block_size"]
    start = gen.integers(0, len(data) - T, RECIPE["batch_size"])
    window = torch.from_numpy(data[start[:, None] + np.arange(T + 1)].astype(np.int64))
    return window[:, :-1], window[:, 1:]


def plain_steps(model, opt, data_dir, n, gen, it0=0):
    """n iterations of the plain loop; returns the last loss."""
    for it in range(it0, it0 + n):
        lr = LR * min(1.0, (it + 1) / 100)  # warmup, as a schedule costs
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = plain_batch(data_dir, "train", gen)
        loss = model(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lossf = loss.item()
    return lossf


def plain_run(data_dir, args):
    """The whole plain command (--plain_run=DIR): the nanoGPT-equivalent plain loop (learned
    positions) for --iters iterations with train.py's evaluations and checkpoint writes, one
    line per 10 iterations (args: train_speed.py's options)."""
    model = plain_model("learned")
    opt = plain_optimizer(model)
    gen = np.random.default_rng(1337)
    out = os.path.join(data_dir, "plain-out")
    os.makedirs(out, exist_ok=True)
    n, every = args["iters"], args["eval_interval"]
    for it in range(0, n + 1, 10):
        if it % every == 0 or it == n:
            model.eval()
            with torch.no_grad():
                for i, split in enumerate(("train", "val")):
                    egen = np.random.default_rng([1337, i])
                    losses = [model(*plain_batch(data_dir, split, egen))[1].item()
                              for _ in range(args["eval_iters"])]
                    print(f"iter {it}: {split} {sum(losses) / len(losses):.4f}")
            model.train()
            if it > 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                           os.path.join(out, "ckpt.pt.tmp"))
                os.replace(os.path.join(out, "ckpt.pt.tmp"), os.path.join(out, "ckpt.pt"))
        if it < n:
            print(f"iter {it + 10}: loss {plain_steps(model, opt, data_dir, 10, gen, it):.4f}",
                  flush=True)



def char_text(args):
    """--text as one string (a folder: its .txt files in name order), cut to --text_chars."""
    path = os.path.join(ROOT, args["text"])
    if os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                       if f.endswith(".txt"))
    elif os.path.isfile(path):
        files = [path]
    else:
        sys.exit(f"error: --text={args['text']} is not a file or folder (nanoGPT's input.txt, "
                 f"or any text: --text=PATH)")
    parts, size = [], 0
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            parts.append(fh.read())
        size += len(parts[-1])
        if size >= args["text_chars"]:
            break
    return "".join(parts)[:args["text_chars"]]


def recipe_lr(it, n, warmup=WARMUP, cooldown=0.0):
    """The rate at iteration it of an n-iteration schedule: nanoGPT's at its shakespeare_char
    settings by default (warmup 100, cosine to lr/10 at n); cooldown=F is train.py's
    --cooldown (flat at the peak, then linear to lr/10 over the last F of the decay)."""
    if it < warmup:
        return LR * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / max(1, n - warmup))
    if cooldown:
        frac = min(1.0, (1.0 - ratio) / cooldown)
    else:
        frac = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return LR / 10 + frac * (LR - LR / 10)


class TargetRun:
    """One model + optimizer trained in chunks, its batches from its own seeded generator."""

    def __init__(self, kind, vocab_size, args):
        torch.manual_seed(args["seed"])  # the same initial draw for every run
        ours = kind != "nanoGPT, AdamW"  # the --ours_* options are for our two runs only
        if not ours:
            self.model = recipe_model("learned", vocab_size)
            self.opt = plain_optimizer(self.model)
        else:
            self.model = recipe_model("rope", vocab_size, qk_norm=args.get("ours_qk_norm", False))
            rate = args.get("ours_lr") or LR  # AdamW's part: all of it, or Muon's non-matrices
            self.opt = build_optimizer(self.model, rate, WEIGHT_DECAY, BETAS, "cpu",
                                       name=kind.split(", ")[1].lower(), muon_lr=args["muon_lr"],
                                       bf16=native_bf16("cpu"))  # as train.py builds it
        self.kind, self.gen = kind, np.random.default_rng(args["seed"])
        bf16 = ours and args.get("ours_dtype") == "bfloat16"  # resolved
        self.autocast = lambda: torch.autocast("cpu", torch.bfloat16, enabled=bf16)
        # the schedule: nanoGPT's recipe, or for ours its own (--ours_iters, _warmup, _cooldown)
        self.total_iters, self.warmup, self.cooldown = args["target_iters"], WARMUP, 0.0
        if ours and args.get("ours_iters"):
            self.total_iters = args["ours_iters"]
            self.warmup, self.cooldown = args["ours_warmup"], args["ours_cooldown"]
        self.it, self.seconds, self.curve = 0, 0.0, []  # curve: (iteration, seconds, val loss)
        # --ours_short: the first iterations on shorter windows
        self.short = (args.get("ours_short", 0), args.get("ours_short_block")) if ours else \
            (0, None)

    def train(self, data, n):
        t0 = time.perf_counter()
        for _ in range(n):
            # the fraction of each group's peak rate
            frac = recipe_lr(self.it, self.total_iters, self.warmup, self.cooldown) / LR
            for g in self.opt.param_groups:
                g["lr"] = frac * g.get("base_lr", LR)
            T = self.short[1] if self.it < self.short[0] else RECIPE["block_size"]
            start = self.gen.integers(0, len(data) - T, RECIPE["batch_size"])
            xy = torch.from_numpy(data[start[:, None] + np.arange(T + 1)])
            with self.autocast():
                loss = self.model(xy[:, :-1], xy[:, 1:])[1]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            loss.item()  # nanoGPT reads the loss every iteration (its log line)
            self.it += 1
        self.seconds += time.perf_counter() - t0

    def score(self, batches):
        self.model.eval()
        with torch.no_grad(), self.autocast():  # as train.py evaluates: in its dtype
            loss = statistics.mean(self.model(x, y)[1].item() for x, y in batches)
        self.model.train()
        self.curve.append((self.it, self.seconds, loss))


def ours_schedule(args):
    """Ours' recipe in words, for the table's heading."""
    rate = f"AdamW's rate {args.get('ours_lr') or LR:g}"
    rate += ", qk_norm" if args.get("ours_qk_norm") else ""
    rate += ", bf16 autocast" if args.get("ours_dtype") == "bfloat16" else ", float32"
    if args.get("ours_short"):
        rate += (f", the first {args['ours_short']} iterations on "
                 f"{args['ours_short_block']}-token windows")
    if not args.get("ours_iters"):
        return f"ours on nanoGPT's schedule, {rate}"
    decay = (f"flat, then linear over the last {args['ours_cooldown']:g} of the decay"
             if args["ours_cooldown"] else "cosine")
    return (f"ours on its own schedule: {args['ours_iters']} iterations, {rate}, warmup "
            f"{args['ours_warmup']}, {decay} to lr/10")


def check_ours(args):
    """Resolve --ours_dtype, refuse what cannot run, in one line each."""
    try:  # "auto" as train.py resolves it; nothing else that train.py refuses on a CPU
        args["ours_dtype"] = pick_device("cpu", args["ours_dtype"], training=True)[1]
    except UserError as e:
        sys.exit(f"error: --ours_dtype: {e}")
    if args["ours_short"] < 0 or not 1 <= args["ours_short_block"] <= RECIPE["block_size"]:
        sys.exit(f"error: --ours_short must be >= 0 and --ours_short_block in 1.."
                 f"{RECIPE['block_size']}, got {args['ours_short']} and {args['ours_short_block']}")


def target(threads, args):
    torch.set_num_threads(threads)
    check_ours(args)
    text = char_text(args)
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((lookup[c] for c in text), dtype=np.int64, count=len(text))
    cut = int(0.9 * len(ids))
    train_ids, val_ids = ids[:cut], ids[cut:]
    vgen, T = np.random.default_rng([args["seed"], 1]), RECIPE["block_size"]
    batches = []
    for _ in range(args["target_batches"]):
        xy = torch.from_numpy(val_ids[vgen.integers(0, len(val_ids) - T, RECIPE["batch_size"])
                                      [:, None] + np.arange(T + 1)])
        batches.append((xy[:, :-1], xy[:, 1:]))
    runs = [TargetRun(k, len(chars), args) for k in ("nanoGPT, AdamW", "ours, Muon", "ours, AdamW")]
    n, every = args["target_iters"], args["target_eval"]
    for c in range(0, n, every):
        for r in runs[c // every % 3:] + runs[:c // every % 3]:  # rotate who goes first
            if r.it < r.total_iters:  # ours may run a shorter schedule of its own
                r.train(train_ids, min(every, n - c, r.total_iters - r.it))
                r.score(batches)
        print(f"iter {runs[0].it}: " + ", ".join(f"{r.curve[-1][2]:.4f} ({r.seconds:.2f} s)"
                                                 for r in runs), file=sys.stderr, flush=True)
    base = runs[0]
    goal = base.curve[-1][2]
    shape = {k: v for k, v in RECIPE.items() if k != "vocab_size"}
    print(f"\n{args['text']}: {len(text):,} characters, vocab {len(chars)}, held out the last "
          f"10%; nanoGPT's CPU recipe {shape}, {n} iterations, float32, eager, {threads} "
          f"thread(s), seed {args['seed']}, muon_lr {args['muon_lr']}; {ours_schedule(args)}; "
          f"held-out loss (nats/char) over {args['target_batches']} batches every {every} "
          "iterations; time = training only")
    # The machine is shared and its load drifts, but each chunk of every run ran side by side:
    # so the time to the target is compared with nanoGPT's time over the same iterations, and
    # scaled by that iteration's share of nanoGPT's run (its steps all cost the same work).
    print("| run | final loss | - nanoGPT's | reaches nanoGPT's final at iter | train s there | "
          "nanoGPT's s there | time vs nanoGPT's whole run | total train s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        hit = next(((i, s) for i, s, v in r.curve if v <= goal), None)
        where = "- | - | - | -"
        if hit:
            base_s = next(s for i, s, _ in base.curve if i == hit[0])
            where = f"{hit[0]} | {hit[1]:.1f} | {base_s:.1f} | {hit[1] / base_s * hit[0] / n:.3f}x"
        print(f"| {r.kind} | {r.curve[-1][2]:.4f} | "
              f"{r.curve[-1][2] - goal:+.4f} | {where} | {r.seconds:.1f} |")
