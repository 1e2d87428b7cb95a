"""The position designs' study, one command: each position design (a named set of RoFormerConfig keys) is
trained at block B with N seeds, read at 1x..8x B at inference only, then fine-tuned at 4B
(`train.py --init_from`, at most --ft_share of the pretraining tokens, on documents longer than
4B) and read again; two models, as bench/studies/context.py: config/small.py's on the default corpus
(bits per byte on long held-out documents) and a passkey model (the single-key grid,
`eval.py --passkey --keys=1`, and the multi-key one, `--keys=K`). The 1x comparison with plain
RoPE at equal tokens is bench/compare.py's (stage `compare`); the report checks the targets.

    python bench/studies/designs.py                                  # everything at the defaults
    python bench/studies/designs.py --stages=text,report --seeds=1   # a part; finished work is reused
    python bench/studies/designs.py --designs='rope:;half:rotary_fraction=0.5'
    python bench/studies/designs.py --readings="temp03:--length_temperature=0.3"  # base runs read again

--designs: `NAME:KEY=VALUE KEY=VALUE;NAME:...`; the first is the reference (plain RoPE by
default); a value `B/n` is the model's block divided by n (the text and passkey models have
their own B). Resumable: a run whose log reached its last iteration and an evaluation whose
JSON exists are reused (bench/studies/study.py); a design name is bound to its keys in --out, so that
a changed design is never read from another's runs. Under --out (default
bench/results/designs, git-ignored): runs/, logs/, evals/, data/, compare/ (bench/compare.py's
folder), results.json (rows, runs with their wall minutes, fine-tune shares, targets),
tables.md and designs.png (the plot, where matplotlib is installed).
"""
import argparse
import dataclasses
import json
import os
import sys
import time

from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lab"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import study  # noqa: E402  (the run helpers: shared with context.py)
from study import (ROOT, ensure_corpus, eval_set, evaluate, last_line, lengths_of,  # noqa: E402
                   long_corpus, passkey_mix, sh, tag_rows, train)
from designs_report import key_counts, report, within_noise  # noqa: E402
from lab_runs import write_atomic  # noqa: E402
from harness.common import UserError, cli  # noqa: E402

DESIGNS = ("rope:;half:rotary_fraction=0.5;"
           "prope:rotary_fraction=0.25 rope_base=10;"  # p-RoPE: 10000 ** 0.25 (docs/MODEL.md)
           "nope4:nope_every=4;local4:window=B/4 global_every=4;"
           "rnope_swa:window=B/4 global_every=4 nope_every=4;"  # RNoPE-SWA: the global layers NoPE
           "local4_temp:window=B/4 global_every=4 length_temperature=0.3")
# the fine-tunes' rates: the base run's final ones, which cost 1x the least in docs/CONTEXT.md's part 1 check
# (docs/CONTEXT.md, "a gentler fine-tune")
FT_LR = ["--learning_rate=2e-4", "--muon_lr=0.004", "--min_lr=2e-5"]  # warmup: 5 or fewer
# the passkey model's: part 1's fine-tune rates, which taught far recall (at FT_LR's, a passkey
# model that recalls nothing at 1x learns nothing more in its fine-tune: docs/CONTEXT.md)
PK_FT_LR = ["--learning_rate=6e-4", "--muon_lr=0.01", "--min_lr=6e-5"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "designs"))
    p.add_argument("--stages", default="text,passkey,compare,report",
                   help="text, passkey, compare, report")
    p.add_argument("--designs", default=DESIGNS, help="NAME:KEY=VALUE ...;NAME:... (see above)")
    p.add_argument("--seeds", type=int, default=2, help="seeds a design (1337, 1338, ...)")
    p.add_argument("--data_dir", default=os.path.join(ROOT, "data", "pystdlib"))
    p.add_argument("--train", default="", help="more train.py options for every run, e.g. "
                   "'--n_layer=1 --n_embd=32' (a smaller model)")
    p.add_argument("--block_size", type=int, default=256, help="the text model's B")
    p.add_argument("--iters", type=int, default=300, help="the text model's iterations")
    p.add_argument("--multiples", default="1,2,4,8", help="lengths read, as multiples of B")
    p.add_argument("--eval_docs", type=int, default=6, help="held-out documents scored")
    p.add_argument("--eval_doc_tokens", type=int, default=4096, help="each cut to this many")
    p.add_argument("--ft_share", type=float, default=0.10,
                   help="fine-tune tokens, at most this share of the pretraining tokens")
    p.add_argument("--ft_iters", type=int, default=0, help="0: the most within --ft_share")
    p.add_argument("--ft_batch", type=int, default=4, help="fine-tune sequences a step")
    p.add_argument("--pk_block", type=int, default=128, help="the passkey model's B_p")
    p.add_argument("--pk_iters", type=int, default=1500)
    p.add_argument("--pk_docs", type=int, default=60000, help="passkey training documents")
    p.add_argument("--pk_vocab", type=int, default=1024, help="the passkey tokenizer's vocab")
    p.add_argument("--pk_keys", type=int, default=1, help="keys of the multi-key grid (1: none; "
                   "K > 1 trains on a mix that taught no retrieval in 1,500 iterations here)")
    p.add_argument("--pk_samples", type=int, default=20, help="passkey prompts per cell")
    p.add_argument("--pk_depths", default="0,0.25,0.5,0.75,1")
    p.add_argument("--compare_seeds", type=int, default=3, help="bench/compare.py's --seeds")
    p.add_argument("--readings", default="", help="NAME:EVAL_ARGS;..: every base run read again "
                   "with eval.py's EVAL_ARGS, at inference only (stage inference+NAME), e.g. "
                   "'temp03:--length_temperature=0.3'")
    args = p.parse_args(argv)
    args.stages = args.stages.split(",")
    unknown = set(args.stages) - {"text", "passkey", "compare", "report"}
    if unknown:
        raise UserError(f"--stages: unknown {', '.join(sorted(unknown))} (text, passkey, "
                        f"compare, report)")
    args.multiples = [float(m) for m in args.multiples.split(",")]
    args.designs = parse_designs(args.designs)
    args.readings = parse_readings(args.readings)
    args.train = args.train.split()
    if args.seeds < 1 or not 0 < args.ft_share <= 1:
        raise UserError("need --seeds >= 1 and 0 < --ft_share <= 1")
    return args


# ----------------------------------------------------------------------------------------
# designs: named sets of RoFormerConfig keys


def parse_designs(spec):
    """{name: {key: value string}} in the given order; keys checked against RoFormerConfig."""
    from harness.flags import configure
    from model import RoFormerConfig
    fields = {f.name: f.default for f in dataclasses.fields(RoFormerConfig)}
    designs = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, colon, keys = item.partition(":")
        if not colon or not name.replace("_", "").replace("-", "").isalnum():
            raise UserError(f"--designs: {item!r} is not NAME:KEY=VALUE ... (NAME: letters, "
                            f"digits, _ and -)")
        if name in designs:
            raise UserError(f"--designs: {name!r} is given twice")
        pairs = [kv.partition("=") for kv in keys.split()]
        if any(not eq or not k for k, eq, _ in pairs):
            raise UserError(f"--designs: {name}: expected KEY=VALUE items, got {keys!r}")
        designs[name] = {k: v for k, _, v in pairs}
        try:  # `B/n` typed as its value at B = 256, so the type check sees a number
            configure(fields, [f"--{k}={resolve(v, 256)}" for k, v in designs[name].items()])
        except UserError as e:
            raise UserError(f"--designs: {name}: {e}") from None
    if not designs:
        raise UserError("--designs: no design given")
    return designs


def parse_readings(spec):
    """{name: eval.py arguments}: the extra inference-only readings of every base run."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, colon, extra = item.partition(":")
        if not colon or not name.isidentifier() or not extra.split() or name in out:
            raise UserError(f"--readings: {item!r} is not NAME:EVAL_ARGS with a new NAME "
                            f"(letters, digits, _)")
        out[name] = extra.split()
    return out



def resolve(value, block):
    """A design's value with `B/n` (or `B`) made the model's block (divided by n)."""
    if value == "B" or value.startswith("B/"):
        n = int(value[2:]) if value != "B" else 1
        if block % n:
            raise UserError(f"{value} at block {block} is not a whole number")
        return str(block // n)
    return value


def design_args(keys, block):
    return [f"--{k}={resolve(v, block)}" for k, v in keys.items()]


def bind_designs(out, designs):
    """A design name keeps its keys in `out` (designs.json): a name given again with other
    keys is refused, so no run of the old design is reused for the new one."""
    path = os.path.join(out, "designs.json")
    known = {}
    if os.path.exists(path):
        with open(path) as f:
            known = json.load(f)
    for name, keys in designs.items():
        if name in known and known[name] != keys:
            raise UserError(f"design {name!r} ran in {out} with other keys ({known[name]}); "
                            f"give it another name or another --out")
    os.makedirs(out, exist_ok=True)
    write_atomic(path, json.dumps({**known, **designs}, indent=1))


# ----------------------------------------------------------------------------------------
# the fine-tune: documents longer than its window, at most --ft_share of the tokens


def ft_iters(args, base_tokens, block):
    """The fine-tune's iterations at 4 * block: --ft_iters, or the most whose tokens stay
    within --ft_share of base_tokens; refused past the share."""
    per_iter = args.ft_batch * 4 * block  # gradient_accumulation_steps=1 (fine_tune passes it)
    iters = args.ft_iters or int(args.ft_share * base_tokens // per_iter)
    if iters < 1 or iters * per_iter > args.ft_share * base_tokens:
        raise UserError(f"a fine-tune of {max(iters, 1)} x {per_iter:,} tokens is over "
                        f"--ft_share={args.ft_share:g} of the {base_tokens:,} pretraining tokens")
    return iters


def fine_tune(args, name, base, block, data, extra, rates):
    """The base run continued at 4 * block on `data` at `rates`; returns (run, its share
    record)."""
    base_tokens = last_line(os.path.join(base, "log.jsonl"))["tokens"]
    iters = ft_iters(args, base_tokens, block)
    run = study.fine_tune(args.out, name, base, block, iters, args.ft_batch,
                          extra + args.train + [f"--data_dir={data}",
                                                "--gradient_accumulation_steps=1",
                                                f"--warmup_iters={min(5, iters)}"], rates)
    tokens = last_line(os.path.join(run, "log.jsonl"))["tokens"]
    share = dict(run=name, base_tokens=base_tokens, ft_tokens=tokens, share=tokens / base_tokens)
    study.ECHO(f"{name}: {tokens:,} fine-tune tokens = {share['share']:.1%} of the "
               f"{base_tokens:,} pretraining tokens")
    return run, share


# ----------------------------------------------------------------------------------------
# the two models, each design and seed: a base run, its readings, its fine-tune, its readings


def step(bar, label, fn, *a):
    bar.set_postfix_str(label)
    result = fn(*a)
    bar.update(1)
    return result


def design_rows(args, bar, model, block, base_cmd, ft_cmd, evals):
    """Every design and seed of one model, seed-major (a change of load falls on every design
    alike): base run, its readings, fine-tune at 4 * block, its readings. base_cmd(keys, seed)
    is the base's train.py arguments; ft_cmd: (the fine-tune's data, its model arguments, its
    rates);
    evals: {suffix: eval.py arguments}. Returns (rows, fine-tune share records)."""
    rows, shares = [], []
    iters = args.iters if model == "text" else args.pk_iters
    for seed in range(1337, 1337 + args.seeds):
        for name, keys in args.designs.items():
            tag = f"{model}_{name}_s{seed}"
            base = step(bar, tag, train, args.out, tag, base_cmd(keys, seed), iters)
            ft, share = step(bar, tag + "_ft4x", fine_tune, args, tag + "_ft4x", base, block,
                             ft_cmd[0], [f"--seed={seed}"] + ft_cmd[1], ft_cmd[2])
            shares.append(dict(share, model=model, design=name, seed=seed))
            readings = [("inference", base, "", []), ("finetuned", ft, "_ft4x", [])] + [
                (f"inference+{r}", base, f"_{r}", more) for r, more in args.readings.items()]
            for stage, run, suffix, more in readings:
                for what, extra in evals.items():
                    got = step(bar, tag + suffix + what, evaluate, args.out, tag + suffix + what,
                               run, extra + more)
                    rows += tag_rows(got, model=model, design=name, seed=seed, stage=stage,
                                     keys=int(what[2:]) if what else 0)
    return rows, shares


def text_study(args, bar):
    """config/small.py on the corpus at block B; bits per byte on long held-out documents."""
    ensure_corpus(args.data_dir)
    folder = eval_set(args.out, args.data_dir, args.eval_docs, args.eval_doc_tokens)
    B = args.block_size
    long, info = long_corpus(args.out, args.data_dir, 4 * B)
    study.ECHO(f"text fine-tune documents: the {info['documents']} training documents of at "
               f"least {4 * B} tokens ({info['tokens']:,} tokens, median {info['median_tokens']},"
               f" longest {info['longest_tokens']})")

    def base_cmd(keys, seed):
        return ["config/small.py", f"--data_dir={args.data_dir}", f"--block_size={B}",
                f"--lr_decay_iters={args.iters}", f"--seed={seed}"] + args.train + \
               design_args(keys, B)
    lengths = ",".join(map(str, lengths_of(B, args.multiples)))
    rows, shares = design_rows(args, bar, "text", B, base_cmd, (long, [], FT_LR),
                               {"": [f"--input={folder}", f"--lengths={lengths}"]})
    return rows, shares, dict(text_ft_documents=info)


def passkey_study(args, bar):
    """A 4-layer, 128-wide model at block B_p on documents that fit B_p whole; its fine-tune
    at 4 B_p on documents up to 4 B_p long; accuracy per length and depth, 1 and K keys."""
    bp, k = args.pk_block, args.pk_keys
    # ~3 tokens a filler word with a 1,024-piece tokenizer, ~40 tokens of one key and its
    # question, ~14 more a further labelled key
    words = lambda n: max(1, (n - 40 - 14 * (k - 1)) // 3)  # noqa: E731
    mix = (args.pk_docs, k, args.pk_vocab)
    short = passkey_mix(args.out, f"passkey{bp}", words(bp), *mix)
    model = ["--n_embd=128", "--batch_size=16", "--warmup_iters=50"]

    def base_cmd(keys, seed):
        return ["config/small.py", f"--data_dir={short}", f"--block_size={bp}",
                f"--lr_decay_iters={args.pk_iters}", f"--eval_interval={args.pk_iters // 3}",
                f"--seed={seed}"] + model + args.train + design_args(keys, bp)
    long = passkey_mix(args.out, f"passkey{4 * bp}", words(4 * bp), *mix,
                       os.path.join(short, "tokenizer.model"))
    grid = ["--passkey", f"--depths={args.pk_depths}", f"--samples={args.pk_samples}",
            "--seed=4242", f"--lengths={','.join(map(str, lengths_of(bp, [1, 2, 4, 8])))}"]
    rows, shares = design_rows(
        args, bar, "passkey", bp, base_cmd, (long, model[:1], PK_FT_LR),
        {f"_k{n}": grid + [f"--keys={n}"] for n in key_counts(args)})
    keys = "1 unlabelled key" + (f" or 1-{k} labelled ones" if k > 1 else "")
    return rows, shares, dict(passkey_ft_documents=f"0-{words(4 * bp)} filler words, {keys}, "
                              f"up to {4 * bp} tokens")


# ----------------------------------------------------------------------------------------
# the 1x comparison: bench/compare.py, each design against the reference at equal tokens


def compare_specs(args):
    """{design: its bench/compare.py --variant} for every design but the reference."""
    names = list(args.designs)
    return {n: " ".join(a[2:] for a in design_args(args.designs[n], args.block_size))
            for n in names[1:]}


def compare_stage(args):
    ref = design_args(next(iter(args.designs.values())), args.block_size)
    sh(["bench/compare.py", "config/small.py", f"--max_iters={args.iters}",
        f"--seeds={args.compare_seeds}", f"--data_dir={args.data_dir}",
        f"--out={os.path.join(args.out, 'compare')}", f"--block_size={args.block_size}",
        "--variant=base"] + [f"--variant={v}" for v in compare_specs(args).values()]
       + args.train + ref, os.path.join(args.out, "logs", "compare.log"))


def stored(out, stage):
    path = os.path.join(out, f"rows_{stage}.json")
    if not os.path.exists(path):
        return [], [], {}
    with open(path) as f:
        return json.load(f)


@cli
def main(argv):
    """Each model's stage saves (rows, shares, info) in rows_<stage>.json; the report reads
    every stage run so far, so stages may run in separate invocations."""
    args = parse_args(argv)
    bind_designs(args.out, args.designs)
    t0, n = time.time(), args.seeds * len(args.designs)
    r, grids = len(args.readings), len(key_counts(args))  # passkey: grids a reading
    steps = {"text": (4 + r) * n, "passkey": (2 + (2 + r) * grids) * n, "compare": 1}
    total = sum(steps[s] for s in args.stages if s in steps)
    bar = tqdm(total=total, unit="step", desc="designs", dynamic_ncols=True, disable=not total)
    study.ECHO = bar.write
    for stage, fn in (("text", text_study), ("passkey", passkey_study)):
        if stage in args.stages:
            write_atomic(os.path.join(args.out, f"rows_{stage}.json"),
                         json.dumps(fn(args, bar)))
    if "compare" in args.stages:
        step(bar, "compare", compare_stage, args)
    bar.close()
    if "report" in args.stages:
        got = [stored(args.out, s) for s in ("text", "passkey")]
        report(args, sum((g[0] for g in got), []), sum((g[1] for g in got), []),
               {k: v for g in got for k, v in g[2].items()},
               within_noise(args.out, compare_specs(args)))
    print(f"done in {(time.time() - t0) / 60:.1f} minutes")


if __name__ == "__main__":
    main(sys.argv[1:])
