"""Starting from a checkpoint (train.py imports this only then): init_from=resume, or a torchrun
restart of this run, continues it exactly; init_from=RUN starts a new run from RUN's weights."""
import contextlib
import dataclasses
import json
import os
import re
from pathlib import Path

from harness.checkpoint import set_rng_state
from harness.load import misfit, read, rescale
from harness.common import REPO, UserError
from harness.dataset import prepare_command
from harness.files import atomic_write
from model import RoFormerConfig


def find(out_dir, asked, run_id, restarts, master):
    """The checkpoint to resume, or None: out_dir's when `asked` (init_from=resume); after a
    torchrun restart, out_dir's only if this run (`run_id`) wrote it."""
    path = os.path.join(out_dir, "ckpt.pt")
    if asked and not os.path.exists(path):
        raise UserError(f"init_from=resume but {path} does not exist")
    if not os.path.exists(path):
        return None
    ckpt = read(path, mmap=True)  # every rank reads the metadata; weights paged in when used
    if not asked and ckpt.get("run_id") != run_id:
        return None
    check_format(ckpt, path)
    if master and not asked:
        print(f"restart {restarts}: resuming from {path}", flush=True)
    return ckpt


def recorded_dataset(ckpt, c, given):
    """A resume whose command names no dataset (--dataset, --data_dir, in flags or config
    files: `given`) reads the one the checkpoint's run read: its folder where it still is,
    else data/<dataset> next to train.py; else one line, before anything is built (the default
    corpus, built for a fresh clone, would be another tokenizer's)."""
    if given & {"dataset", "data_dir"}:
        return
    conf = ckpt.get("config") or {}
    c["dataset"] = conf.get("dataset", c["dataset"])
    recorded, here = conf.get("data_dir") or "", os.path.join(REPO, "data", c["dataset"])
    for folder in filter(None, (recorded, here)):
        if os.path.isfile(os.path.join(folder, "meta.json")):
            c["data_dir"] = folder
            return
    raise UserError(f"the run resumed read the dataset {c['dataset']!r} from "
                    f"{recorded or here}, which is not here: prepare it with "
                    f"{prepare_command(c['dataset'], recorded)}, or pass --data_dir=DIR")


def check_format(ckpt, path):
    """Refuse in one line a checkpoint train.py cannot start from: one without the tokenizer
    record (nanoGPT's shape), or model_args with a key this model.py lacks (another version's:
    dropping the key would silently build another model)."""
    if not isinstance(ckpt.get("tokenizer"), dict):
        raise UserError(f"{path} records no tokenizer: it was not written by this project's "
                        f"train.py (a nanoGPT checkpoint?), so a run cannot start from it")
    unknown = sorted(set(ckpt["model_args"]) - {f.name for f in dataclasses.fields(RoFormerConfig)})
    if unknown:
        raise UserError(f"{path}: model_args has {', '.join(unknown)}, which this model.py does "
                        f"not know (written by another version of the code?)")


def check(ckpt, config, tokenizer, loop_keys, master):
    """Resume only with the checkpoint's tokenizer and optimizer; note (rank 0) the keys this
    command changes. Model keys always come from the checkpoint; `loop_keys` only say how long
    and how often, so changing them is expected."""
    model_args = ckpt["model_args"]
    differ = [k for k in config if k not in loop_keys and k in ckpt["config"]
              and ckpt["config"][k] != config[k]
              and not (k in model_args and model_args[k] == config[k])]
    if master and differ:
        print(f"note: resuming with {', '.join(differ)} changed from the checkpoint's run "
              f"(model keys are taken from the checkpoint; the rest from this command)")
    saved_optimizer = ckpt["config"].get("optimizer", "adamw")  # older runs: AdamW
    if saved_optimizer != config["optimizer"]:
        raise UserError(f"the checkpoint holds the state of optimizer={saved_optimizer}; resume "
                        f"with --optimizer={saved_optimizer}")
    if ckpt["tokenizer"]["sha256"] != tokenizer["sha256"]:
        raise UserError(tokenizer_differs(ckpt, config, tokenizer))


def tokenizer_differs(ckpt, config, tokenizer):
    """Why the dataset this command reads cannot resume the run, and the way on: the run's
    own folder prepared again since (one path: say so, once), or another folder."""
    theirs, path = ckpt["tokenizer"], tokenizer["path"]
    sha = lambda info: (info.get("sha256") or "none")[:12]  # noqa: E731
    folder = os.path.dirname(path)
    if theirs.get("path") == path:
        return (f"{path} is not the tokenizer this run trained with (sha256 {sha(tokenizer)}..., "
                f"the checkpoint's {sha(theirs)}...): {folder} was prepared again since; to "
                f"resume on it, prepare it with the run's tokenizer: "
                f"{prepare_command(config['dataset'], folder)} --tokenizer={config['out_dir']}")
    return (f"the checkpoint's tokenizer ({theirs.get('path')}) is not {path} (the dataset "
            f"{folder} this command reads); resume with the run's dataset: --data_dir="
            f"{os.path.dirname(theirs.get('path') or '') or '...'}")


def load_state(ckpt, path, raw_model, optimizer, scaler):
    """Weights, optimizer and loss-scaler state of `ckpt` (read from `path`), however they are
    sharded now (harness/parallel.py reshards an FSDP run's DCP folder to any number of ranks, FSDP
    or not), and the global RNGs. The optimizer keeps this command's hyperparameters."""
    if "sharded" not in ckpt and "optimizer" not in ckpt:
        raise UserError(f"{path} holds no optimizer state: it cannot be resumed")
    # load_state_dict also brings back the old run's hyperparameters (weight_decay, betas,
    # eps, fused, ...); this command's settings are the ones that must run, so put them back.
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        if "sharded" in ckpt or hasattr(raw_model, "reshard"):  # an FSDP run or model
            from harness import parallel
            parallel.load_state(ckpt, path, raw_model, optimizer)
        else:
            raw_model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError) as e:  # weights or optimizer state of another shape
        raise UserError(misfit(path, e)) from None
    for group, kept in zip(optimizer.param_groups, settings):
        group.update(kept)
    if ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    set_rng_state(ckpt["rng"])  # batches and dropout reseed every micro-step anyway


def restore(ckpt, path, raw_model, optimizer, scaler, tokens_per_iter, master):
    """load_state, then where the run stands: (iteration, best val loss, tokens seen, wandb
    id, seconds run: log.jsonl's time_s goes on from there). A resumed run may use another
    batch size: its tokens are counted, not iterations."""
    load_state(ckpt, path, raw_model, optimizer, scaler)
    iter_num = ckpt["iter_num"]
    tokens = ckpt.get("tokens", iter_num * tokens_per_iter)
    if master:
        print(f"resumed from {path}: iteration {iter_num}, {tokens:,} tokens", flush=True)
    # the wandb id is kept even by a run without wandb, for a later one
    seconds = ckpt.get("time_s")
    if seconds is None:  # a checkpoint from before the key: the log's last time at or before it
        seconds = logged_seconds(os.path.join(os.path.dirname(path), "log.jsonl"), iter_num)
    return iter_num, ckpt["best_val_loss"], tokens, ckpt.get("wandb_id"), seconds


def logged_seconds(log_path, iter_num):
    """The time_s of log.jsonl's last evaluation at or before iter_num (0.0 without one)."""
    seconds = 0.0
    with contextlib.suppress(OSError):
        with open(log_path, errors="replace") as f:
            for line in f:
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    record = json.loads(line)
                    if record["iter"] <= iter_num:
                        seconds = float(record["time_s"])
    return seconds


def repair_log(log_path, start_iter):
    """Drop the evaluations logged after the checkpoint (a crash between the two; they are
    logged again) and lines a crash cut short (with a warning). The log is not the run's
    state: one that cannot be rewritten costs a warning, never the run."""
    try:
        if not os.path.exists(log_path):
            return
        kept, unreadable = [], 0
        with open(log_path, errors="replace") as f:
            for line in f:
                try:
                    it = json.loads(line)["iter"]
                except (ValueError, TypeError, KeyError):
                    unreadable += bool(line.strip())
                    continue
                if it <= start_iter:
                    kept.append(line if line.endswith("\n") else line + "\n")
        if unreadable:
            print(f"warning: {log_path}: dropped {unreadable} unreadable line(s) (a write cut "
                  f"short by a crash?)", flush=True)
        atomic_write(log_path, lambda tmp: Path(tmp).write_text("".join(kept)))
    except OSError as e:
        print(f"warning: cannot rewrite {log_path} ({e.strerror}); training goes on", flush=True)


# ----------------------------------------------------------------------------------------
# init_from=RUN: a new run (iteration 0, a fresh optimizer and schedule) from RUN's weights

# the position designs (docs/MODEL.md): no weights, so a fine-tune may change them; RUN's unless set
POSITION_KEYS = ("rotary_fraction", "nope_every", "window", "global_every", "local_rope_base",
                 "length_temperature")
# What such a run may change: its context, and what changes no weight.
CONTEXT_KEYS = ("block_size", "rope_scaling", "rope_factor", "rope_original", "dropout",
                "linear_chunk") + POSITION_KEYS


def continue_from(source, config, model_keys, tokenizer, out_dir, given, master):
    """(RUN's checkpoint, the new run's model args) after the checks a refused start must make
    before out_dir is touched: RUN's tokenizer (sha256), every model-shape key this command
    sets equal to RUN's (one it leaves is RUN's), another out_dir. RUN's context extension is
    kept unless this command sets it (`given`: the keys its flags and config files set), and
    its original context always (a second extension must not compound); rank 0 says what the
    continuation uses."""
    path = os.path.join(source, "ckpt.pt") if os.path.isdir(source) else source
    if not os.path.isfile(path):
        raise UserError(f"init_from={source}: no such checkpoint file or run folder with ckpt.pt")
    if os.path.abspath(os.path.dirname(path)) == os.path.abspath(out_dir):
        raise UserError(f"init_from={source} is out_dir itself: a new run needs its own out_dir "
                        f"(init_from=resume continues the same run)")
    ckpt = read(path, mmap=True)
    check_format(ckpt, path)
    theirs = {"tie_embeddings": True, **ckpt["model_args"]}  # runs from before the key: tied
    if ckpt["tokenizer"].get("sha256") != tokenizer["sha256"]:
        raise UserError(f"init_from={source} was trained with another tokenizer than "
                        f"{tokenizer['path']}: prepare this corpus with --tokenizer={source}")
    args = context_args({k: config[k] for k in model_keys}, theirs, given)
    for k in model_keys:
        if k in CONTEXT_KEYS or k not in theirs:
            continue
        if k not in given:  # not set by this command: RUN's (a rope_base of 10 stays 10)
            args[k] = theirs[k]
        elif args[k] != theirs[k]:
            raise UserError(f"{k}={args[k]!r} but init_from={source} has {k}={theirs[k]!r}: the "
                            f"model's shape must be RUN's (pass its config, or --{k}={theirs[k]})")
    if args["pos_encoding"] == "learned" and args["block_size"] != theirs["block_size"]:
        raise UserError(f"pos_encoding='learned' has one row per position: block_size cannot "
                        f"change from init_from's {theirs['block_size']}")
    try:  # now, so that a refusal can say which of the values it names are RUN's
        RoFormerConfig(**args)
    except ValueError as e:
        raise UserError(kept_from_run(str(e), source, args, given)) from None
    if master:
        print(context_line(source, args, theirs, given), flush=True)
    return ckpt, args


def kept_from_run(message, source, args, given):
    """`message`, a refusal of the continuation's model args, and which of the values it names
    the command never gave: RUN's position designs and scaling, kept where it sets none (a
    --window=0 on a windowed RUN was refused over RUN's local_rope_base). With the flags that
    drop them, when those make a model that is accepted."""
    defaults = {f.name: f.default for f in dataclasses.fields(RoFormerConfig)}
    kept = [k for k in (*POSITION_KEYS, "rope_scaling", "rope_factor") if k not in given
            and args[k] != defaults[k] and re.search(rf"\b{k}=", message)]
    if not kept:
        return message
    said = ", ".join(f"{k}={args[k]!r}" for k in kept)
    flags = " ".join(f"--{k}={defaults[k]!r}".replace("'", "") for k in kept)
    try:
        RoFormerConfig(**{**args, **{k: defaults[k] for k in kept}})
    except ValueError:
        return (f"{message} ({said} came from init_from={source}: this command does not set "
                f"it, so RUN's is kept; set it with --KEY=VALUE)")
    return (f"{message} ({said} came from init_from={source}: this command does not set it, "
            f"so RUN's is kept; pass {flags} as well)")


def context_args(args, theirs, given):
    """The new run's model args with RUN's context settings where this command leaves them
    (vocab_size 0, rope_scaling, rope_factor and the position designs not given, rope_original
    0)."""
    if args["vocab_size"] == 0:  # not given: RUN's (perhaps padded past the tokenizer's)
        args["vocab_size"] = theirs["vocab_size"]
    args["rope_original"] = args["rope_original"] or theirs.get("rope_original") or \
        theirs["block_size"]
    # RUN's scaling unless set here, by sample.py's and eval.py's rule ("" / 0: the checkpoint's)
    scaled = rescale(theirs, args["rope_scaling"] if "rope_scaling" in given else "",
                     args["rope_factor"] if "rope_factor" in given else 0)
    args.update(rope_scaling=scaled["rope_scaling"], rope_factor=scaled["rope_factor"])
    args.update({k: theirs[k] for k in POSITION_KEYS if k in theirs and k not in given})
    return args


def context_line(source, args, theirs, given):
    """The continuation's first line: the context it trains at, beside RUN's."""
    def scaling(a):
        return f"{a.get('rope_scaling', 'none')} x{float(a.get('rope_factor', 1.0)):g}"

    def beside(mine, run):
        return f"{mine} (as RUN)" if mine == run else f"{mine} (RUN: {run})"
    rope = (f"{scaling(args)} (kept from RUN)" if not given & {"rope_scaling", "rope_factor"}
            else beside(scaling(args), scaling(theirs)))
    return (f"continuing from {source}: rope_scaling {rope}, block_size "
            f"{beside(args['block_size'], theirs['block_size'])}, original context "
            f"{args['rope_original']}")


def load_weights(raw_model, weights, path):
    """RUN's full weights into this run's model (cut into shards under FSDP)."""
    try:
        if hasattr(raw_model, "reshard"):
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 set_model_state_dict)
            set_model_state_dict(raw_model, weights, options=StateDictOptions(full_state_dict=True))
        else:
            raw_model.load_state_dict(weights)
    except (RuntimeError, ValueError) as e:
        raise UserError(misfit(path, e)) from None
