"""Trained checkpoints read past their training length: bench/studies/ablation.py's stage 2 (length
extrapolation: held-out windows of 1x, 2x, 4x block_size, with position interpolation, NTK
scaling and a sliding window besides the plain model) and stage 3 (generation past the
training length: crop-and-recompute against the rolling cache, attention sinks and the
recurrent state, binned by position), each with its table and CSV. The stages are described in
ablation.py's docstring."""
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from harness.load import read  # the importer puts the repo root on sys.path
from model import RoFormer, RoFormerConfig
from lab_runs import write_csv
from stats import spread

MULTIPLES = (1, 2, 4)  # extrapolation lengths, in units of block_size

def load_model(ckpt_path, device, **overrides):
    """The checkpoint's model in eval mode, optionally with rope_scaling/rope_factor changed
    (the cos/sin tables are not in the state dict, so any scaling loads the same weights)."""
    ckpt = read(ckpt_path)  # every reader's: an older run's model_args as it trained
    model = RoFormer(RoFormerConfig(**{**ckpt["model_args"], **overrides}))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


def load_val(data_path):
    meta_path = os.path.join(data_path, "meta.json")
    if not os.path.exists(meta_path):
        sys.exit(f"error: {meta_path} not found (train once, or prepare the dataset)")
    with open(meta_path) as f:
        meta = json.load(f)
    return np.memmap(os.path.join(data_path, "val.bin"), dtype=meta["dtype"], mode="r")


def spaced_windows(val, n, length):
    """n windows of `length` tokens spread evenly over val.bin (int64 tensor (n, length))."""
    if len(val) < length:
        sys.exit(f"error: val.bin has {len(val)} tokens, fewer than the {length} needed")
    n = min(n, len(val) // length)
    starts = np.linspace(0, len(val) - length, n).astype(np.int64)
    return torch.from_numpy(np.stack([val[s:s + length].astype(np.int64) for s in starts]))


def token_losses(model, x, cached=False):
    """Per-token next-token loss of x (B, T+1): (B, T). cached=True runs the same tokens as
    one chunked prefill against a decoding cache: for softmax attention past block_size
    this is sliding-window attention (see caches.KVCache), for linear attention the
    recurrent state."""
    inp, tgt = x[:, :-1], x[:, 1:]
    if cached:
        logits = model(inp, cache=model.new_cache(inp.size(1), inp.device), start_pos=0)[0]
    else:
        logits = model(inp)[0]
    return F.cross_entropy(logits.float().transpose(1, 2), tgt, reduction="none")


def keep_sinks(model, n_sink):
    """Make the rolling cache keep the first n_sink positions (attention sinks) plus the
    last block_size - n_sink: each layer's query m sees keys 0..n_sink-1 and
    m-(block_size-n_sink)+1..m, at their absolute positions, so the cache size and the cost
    per token stay those of the plain rolling cache. Only the attention mask changes, and
    only for one prefill of a whole sequence from an empty cache (where model.py keeps every
    key of the chunk in view and the mask alone decides), which is how token_losses calls it."""
    bs = model.config.block_size
    new_cache = model.new_cache

    def sink_cache(total_len, device):
        cache = new_cache(total_len, device)

        def update(layer, k, v, pos):  # KVCache.update, with the sinks' visibility
            if int(cache.slot_pos[layer].max()) >= 0 or pos.numel() <= cache.slot_pos.size(1):
                raise RuntimeError("keep_sinks supports one prefill longer than block_size only")
            keys, values, key_pos, _ = plain_update(layer, k, v, pos)  # the whole chunk in view
            d = pos[:, None] - key_pos[None, :]  # true distances, also for a relative bias
            recent = (d >= 0) & (d < bs - n_sink)
            sink = (d >= 0) & (key_pos[None, :] >= 0) & (key_pos[None, :] < n_sink)
            return keys, values, key_pos, (recent | sink) & (key_pos[None, :] >= 0)

        plain_update, cache.update = cache.update, update  # instance attributes: this cache only
        return cache

    model.new_cache = sink_cache  # an instance attribute: this model object only
    return model


def scored_positions(T, bs, stride):
    """Context ends t (predicting token t+1) that generation scores: every t inside the first
    block, then every stride-th one."""
    return torch.cat((torch.arange(min(bs, T)), torch.arange(bs, T, stride)))


@torch.no_grad()
def crop_losses(model, x, batch, stride=1):
    """Crop-and-recompute: token t+1 of x (T+1,) predicted from x[max(0, t-bs+1) : t+1]
    run from scratch at positions 0.. (what generate(use_cache=False) does), for the t in
    scored_positions. The first block_size predictions come from one forward; each later one
    from its own window, `batch` windows per forward. Returns (len(scored_positions),)."""
    bs = model.config.block_size
    first = token_losses(model, x[None, :bs + 1])[0]
    # windows starting at 1 .. T-bs: context ends bs .. T-1, every stride-th of them
    wins = x[:-1].unfold(0, bs, 1)[1::stride]
    tgts = x[bs + 1::stride]
    rest = []
    for i in range(0, wins.size(0), batch):
        logits = model(wins[i:i + batch])[0][:, -1]
        rest.append(F.cross_entropy(logits.float(), tgts[i:i + batch], reduction="none"))
    return torch.cat([first] + rest)


# ----------------------------------------------------------------------------------------
# 2. extrapolation

@torch.no_grad()
def extrapolation(args, runs):
    """Rows: run x method; columns: mean next-token loss on windows of 1x, 2x, 4x block_size.
    Every length covers the same tokens (each 4x window split into shorter ones)."""
    val = load_val(args.data_path)
    rows = []
    for run in tqdm(runs, desc="extrapolation", unit="model"):
        ckpt = os.path.join(run["dir"], "ckpt.pt")
        base = load_model(ckpt, args.device)
        bs, c = base.config.block_size, base.config
        big = spaced_windows(val, args.eval_windows, max(MULTIPLES) * bs + 1).to(args.device)
        methods = ["full"]
        if c.attention == "softmax" and c.pos_encoding == "rope":
            methods += ["pi", "ntk"]
        if c.attention == "softmax" and c.pos_encoding != "learned":
            methods.append("window")
        for method in methods:
            row = {"variant": run["variant"], "seed": run["seed"], "method": method}
            for mult in MULTIPLES:
                L = mult * bs
                if method == "full" and c.pos_encoding == "learned" and L > bs:
                    row[f"{mult}x"] = None  # learned positions end at block_size
                    continue
                model = base
                if method in ("pi", "ntk"):
                    model = load_model(ckpt, args.device, rope_scaling=
                                       {"pi": "linear", "ntk": "ntk"}[method], rope_factor=float(mult))
                # (n, 4bs+1) -> (n*4/mult, L+1): consecutive windows share one boundary token
                inp = big[:, :-1].reshape(-1, L)
                tgt = big[:, 1:].reshape(-1, L)
                x = torch.cat((inp, tgt[:, -1:]), dim=1)
                total = 0.0
                for i in range(0, x.size(0), args.eval_batch):
                    total += token_losses(model, x[i:i + args.eval_batch],
                                          cached=method == "window").sum().item()
                row[f"{mult}x"] = total / x[:, 1:].numel()
            rows.append(row)
    return rows


METHOD_NAMES = {"full": "full context", "pi": "position interpolation (rope_scaling=linear)",
                "ntk": "NTK-aware (rope_scaling=ntk)", "window": "sliding window of block_size"}


def extrapolation_report(args, rows, bs):
    write_csv(os.path.join(args.out, "extrapolation.csv"), rows,
              ["variant", "seed", "method"] + [f"{m}x" for m in MULTIPLES])
    groups = {}
    for r in rows:
        groups.setdefault((r["variant"], r["method"]), []).append(r)
    lines = [f"Mean next-token val loss on held-out windows of 1x, 2x, 4x the training length "
             f"({', '.join(str(m * bs) for m in MULTIPLES)} tokens; the same tokens at every "
             f"length); rope_factor = the length multiple; mean over seeds, (min–max) where "
             f"there are several.", "",
             "| variant | method | seeds | " + " | ".join(f"{m}x ({m * bs})" for m in MULTIPLES)
             + " |", "|---|---|---|" + "---:|" * len(MULTIPLES)]
    for (v, method), rs in groups.items():
        lines.append(f"| {v} | {METHOD_NAMES[method]} | {len(rs)} | "
                     + " | ".join(spread([r[f"{m}x"] for r in rs]) for m in MULTIPLES) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# 3. generation past the training length

@torch.no_grad()
def generation(args, runs):
    """Per-token losses on gen_seqs held-out sequences of gen_mult x block_size, for the
    first seed of each variant; returns rows (variant, method, one value per position bin)
    and the bin edges."""
    val = load_val(args.data_path)
    seen, rows = set(), []
    todo = [r for r in runs if not (r["variant"] in seen or seen.add(r["variant"]))]
    for run in tqdm(todo, desc="generation", unit="model"):
        ckpt = os.path.join(run["dir"], "ckpt.pt")
        model = load_model(ckpt, args.device)
        c = model.config
        bs = c.block_size
        N = args.gen_mult * bs
        seqs = spaced_windows(val, args.gen_seqs, N + 1).to(args.device)
        pos = scored_positions(N, bs, args.gen_stride)
        losses = {"crop": torch.stack([crop_losses(model, s, args.crop_batch, args.gen_stride)
                                       for s in seqs])}
        if c.attention == "linear":
            losses["recurrent"] = token_losses(model, seqs, cached=True)
        elif c.pos_encoding != "learned":
            losses["full"] = token_losses(model, seqs)
            losses["rolling"] = token_losses(model, seqs, cached=True)
            if args.sinks:
                losses["sinks"] = token_losses(keep_sinks(load_model(ckpt, args.device),
                                                          args.sinks), seqs, cached=True)
        losses = {k: v if k == "crop" else v[:, pos.to(v.device)] for k, v in losses.items()}
        # inside the first block every method computes the same thing: a check, not a result
        for name, lo in losses.items():
            gap = (lo[:, :bs] - losses["crop"][:, :bs]).abs().max().item()
            if gap > 1e-3:
                raise RuntimeError(f"{run['variant']} {name}: differs from crop-and-recompute "
                                   f"by {gap:.2e} inside the first block (a bug)")
        edges = [0, bs] + [m * bs for m in (2, 4, 8, 16, 32, 64) if m < args.gen_mult] + [N]
        for name, lo in losses.items():
            row = {"variant": run["variant"], "seed": run["seed"], "method": name}
            for a, b in zip(edges[:-1], edges[1:]):
                row[f"{a}-{b - 1}"] = lo[:, (pos >= a) & (pos < b)].mean().item()
            row[f"{bs}-{N - 1}"] = lo[:, pos >= bs].mean().item()
            rows.append(row)
    return rows


GEN_NAMES = {"crop": "crop-and-recompute (last block_size tokens, from scratch)",
             "full": "full context (no window)",
             "rolling": "rolling cache (sliding window)",
             "sinks": "rolling cache + first {k} positions kept (sinks)",
             "recurrent": "recurrent state (all history)"}


def generation_report(args, rows, bs):
    cols = [k for k in rows[0] if k not in ("variant", "seed", "method")]
    write_csv(os.path.join(args.out, "generation.csv"), rows, ["variant", "seed", "method"] + cols)
    N = args.gen_mult * bs
    lines = [f"Mean loss of each next token on {args.gen_seqs} held-out sequences of {N} tokens "
             f"({args.gen_mult}x block_size), by the position of the predicted token's context "
             f"end, every position inside the first block, then every {args.gen_stride}th "
             f"(the first column is inside the training length, where all methods compute the "
             f"same thing: checked); first seed of each variant. The last column is everything "
             f"past block_size. Compare methods within a column: the columns hold different "
             f"text.", "",
             "| variant | method | " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for r in rows:
        lines.append(f"| {r['variant']} | {GEN_NAMES[r['method']].format(k=args.sinks)} | "
                     + " | ".join(f"{r[k]:.3f}" for k in cols) + " |")
    return "\n".join(lines)
