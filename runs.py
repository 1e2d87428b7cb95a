"""
Run management for train.py: which dataset folder, which out_dir, which run, whose checkpoint.

- A run has an id, recorded in its checkpoints. A torchrun restart resumes only its own run's
  checkpoint; a new run moves an older run's checkpoint and log aside instead of overwriting it.
- out_dir is created and checked for writing before any training starts; a command that fails
  before writing anything leaves no empty out_dir behind (fail).
- The default corpus is built on first use; every dataset is checked (data/dataset.py) first.
- log.jsonl is trimmed back to the checkpoint when a run resumes.
- The CPU's peak matmul rate, which CPU MFU is measured against, is timed once per machine
  setup and kept in a small cache file.
"""
import contextlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import torch

from checkpoint import CheckpointError, read
from configurator import file_sha256
from data.dataset import DatasetError, load_meta, open_split

REPO = os.path.dirname(os.path.abspath(__file__))
created_out_dir = None  # the out_dir this command made, removed again if it fails while empty


def fail(msg):
    """One line `error: ...` and exit 1, without leaving behind an out_dir this command made
    and never wrote to."""
    if created_out_dir and os.path.isdir(created_out_dir) and not os.listdir(created_out_dir):
        with contextlib.suppress(OSError):
            os.rmdir(created_out_dir)
    sys.exit(f"error: {msg}")


def barrier(ddp):
    if ddp:
        torch.distributed.barrier()


# ----------------------------------------------------------------------------------------
# the dataset

def prepare_command(dataset, data_dir=""):
    """The command that builds the folder train.py reads: data/<dataset>, or data_dir. A
    dataset with no script of its own is the user's text, whose files only they can name."""
    base = dataset[:-len("_char")] if dataset.endswith("_char") else None
    if os.path.exists(os.path.join(REPO, "data", dataset, "prepare.py")):
        cmd, writes = f"python data/{dataset}/prepare.py", dataset
    elif base and os.path.exists(os.path.join(REPO, "data", base, "prepare.py")):
        # the character-level variant, which writes data/<base>_char
        cmd, writes = f"python data/{base}/prepare.py --char", dataset
    else:
        cmd, writes = "python data/text/prepare.py", "text"
    if cmd.startswith("python data/text/"):
        cmd += " --input PATH"  # required: the files to build it from
    # prepare's --out_dir NAME is data/NAME next to train.py; a path with a slash is as given
    out = data_dir if not data_dir or "/" in data_dir or os.sep in data_dir else f"./{data_dir}"
    if (out or dataset) != writes:
        cmd += f" --out_dir {shlex.quote(out or dataset)}"
    return cmd


def open_dataset(dataset, data_dir, master, ddp):
    """(folder, meta.json) of the dataset, with both splits checked against meta.json. The
    default corpus is built from this Python's standard library (no download, so the first
    command works on a fresh clone): rank 0 builds it, the others wait at the barrier."""
    ddir = data_dir or os.path.join(REPO, "data", dataset)
    needed = ["train.bin", "val.bin", "meta.json"]
    missing = [f for f in needed if not os.path.exists(os.path.join(ddir, f))]
    if missing and dataset == "pystdlib" and not data_dir:
        if master:
            print(f"data/{dataset} not found: building it with data/{dataset}/prepare.py ...",
                  flush=True)
            built = subprocess.run([sys.executable, os.path.join(REPO, "data", dataset,
                                                                 "prepare.py")])
            if built.returncode:
                fail(f"python data/{dataset}/prepare.py failed (exit {built.returncode})")
        barrier(ddp)
        missing = [f for f in needed if not os.path.exists(os.path.join(ddir, f))]
    if missing:
        fail(f"dataset '{dataset}' not found ({ddir} lacks {', '.join(missing)}); build it "
             f"with: {prepare_command(dataset, data_dir)}")
    try:
        meta = load_meta(ddir)
        for split in ("train", "val"):
            open_split(ddir, split, meta)
    except DatasetError as e:
        fail(str(e))
    return ddir, meta


def tokenizer_identity(dataset, data_dir, ddir, meta):
    """What the checkpoint records about the tokenizer: sample.py finds the file by it and
    checks it by its sha256 (None for a dataset without tokenizer.model)."""
    path = os.path.abspath(os.path.join(ddir, "tokenizer.model"))
    return {"dataset": dataset, "data_dir": data_dir, "path": path,
            "sha256": file_sha256(path) if os.path.exists(path) else None,
            "vocab_size": meta["vocab_size"], "eos_id": meta.get("eos_id"),
            "bos_id": meta.get("bos_id")}


def check_split_sizes(ddir, meta, block_size):
    """Both splits hold at least one window of block_size + 1 tokens."""
    for split in ("train", "val"):
        tokens = len(open_split(ddir, split, meta))
        if tokens < block_size + 1:
            fail(f"{ddir}/{split}.bin has {tokens} tokens, fewer than block_size+1 = "
                 f"{block_size + 1}; lower block_size or use more data")


# ----------------------------------------------------------------------------------------
# out_dir, the run, its checkpoint and log

def run_identity():
    """(run id, restart count). Under torchrun the id is the rendezvous id: the same on every
    node and across --max-restarts restarts (--standalone draws a fresh one; across nodes pass
    a unique --rdzv_id, e.g. the SLURM job id). A single process draws its own."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex, restarts


def make_out_dir(out_dir):
    """Create out_dir and check now, before any training, that the run can write its files
    there (a checkpoint, log.jsonl); a full hour of training lost to a typo'd path is worse
    than one line at the start."""
    global created_out_dir
    try:
        if not os.path.isdir(out_dir):
            os.makedirs(out_dir, exist_ok=True)
            created_out_dir = out_dir
        probe = os.path.join(out_dir, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
        log_path = os.path.join(out_dir, "log.jsonl")
        if os.path.lexists(log_path):
            with open(log_path, "a"):
                pass
    except OSError as e:
        fail(f"cannot write to out_dir {out_dir}: {e.strerror} ({e.filename})")


def cxx_compiler_found():
    """Whether torch.compile can build CPU kernels here: inductor compiles them with a C++
    compiler ($CXX, else g++ on Linux and clang++ on macOS) and fails at the first forward,
    with a traceback, where there is none. Asked of inductor itself where this torch has it."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError:  # another torch: look where this one's inductor looks
        default = "clang++" if sys.platform == "darwin" else "g++"
        return shutil.which(os.environ.get("CXX", default)) is not None
    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        return False
    return True


def check_wandb():
    """wandb_log=True: one line now, before out_dir exists, where wandb.init would fail later
    (no package, no login). Offline and disabled modes need no login. Nothing here goes online
    or prompts."""
    try:
        import wandb
    except ImportError:
        fail("wandb_log=True needs the wandb package: pip install wandb")
    try:
        try:  # the mode from the environment and wandb's settings files (`wandb offline`)
            from wandb.sdk.wandb_setup import singleton
            mode = singleton().settings.mode
        except (ImportError, AttributeError):  # an older wandb: the environment's
            mode = os.environ.get("WANDB_MODE", "online")
        if mode in ("offline", "dryrun", "disabled"):
            return
        try:
            logged_in = wandb.login(prompt=False, verify=False)
        except TypeError:  # a wandb before login(prompt=...)
            logged_in = wandb.api.api_key is not None
    except (ValueError, wandb.errors.Error) as e:  # a malformed key or WANDB_MODE
        fail(f"wandb_log=True: {str(e).splitlines()[0]}")
    if not logged_in:
        fail("wandb_log=True but wandb has no login: run `wandb login` or set WANDB_API_KEY, "
             "or log locally with WANDB_MODE=offline")


def load_checkpoint(path):
    try:  # mmap: every rank reads the metadata; the weights are paged in only where needed
        return read(path, mmap=True)
    except CheckpointError as e:
        fail(str(e))


def resume_or_start(out_dir, init_from, run_id, restarts, master, ddp):
    """(checkpoint to resume from or None, init_from as it now is). A torchrun restart after a
    crash continues from the last checkpoint, but only if this run wrote it; a new run moves
    another run's checkpoint aside."""
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    ckpt = None
    if init_from == "resume":
        if not os.path.exists(ckpt_path):
            fail(f"init_from=resume but {ckpt_path} does not exist")
        ckpt = load_checkpoint(ckpt_path)
    elif restarts > 0 and os.path.exists(ckpt_path):
        ckpt = load_checkpoint(ckpt_path)
        if ckpt.get("run_id") == run_id:
            if master:
                print(f"restart {restarts}: resuming from {ckpt_path}", flush=True)
            init_from = "resume"
        else:
            ckpt = None
    if init_from == "scratch" and os.path.exists(ckpt_path):
        barrier(ddp)  # every rank has decided before the file moves
        if master:
            move_aside(out_dir)
    return ckpt, init_from


def check_resume(ckpt, config, tokenizer, loop_keys, master):
    """Resume only with the checkpoint's tokenizer; note (rank 0) the keys this command
    changes. Model keys always come from the checkpoint; `loop_keys` only say how long and how
    often, so changing them is expected."""
    model_args = ckpt["model_args"]
    differ = [k for k in config if k not in loop_keys and k in ckpt["config"]
              and ckpt["config"][k] != config[k]
              and not (k in model_args and model_args[k] == config[k])]
    if master and differ:
        print(f"note: resuming with {', '.join(differ)} changed from the checkpoint's run "
              f"(model keys are taken from the checkpoint; the rest from this command)")
    saved_optimizer = ckpt["config"].get("optimizer", "adamw")  # older runs: AdamW
    if saved_optimizer != config["optimizer"]:
        fail(f"the checkpoint holds the state of optimizer={saved_optimizer}; resume with "
             f"--optimizer={saved_optimizer}")
    if ckpt["tokenizer"]["sha256"] != tokenizer["sha256"]:
        fail(f"the checkpoint's tokenizer ({ckpt['tokenizer']['path']}) differs from "
             f"{tokenizer['path']}; resume with the same dataset")


def move_aside(out_dir):
    """A new run never overwrites another run's work, and a restart must not mistake it for its
    own: move the old checkpoint and its log aside, stamped with the checkpoint's time."""
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(ckpt_path)))
    for name, ext in (("ckpt", ".pt"), ("log", ".jsonl")):
        old = os.path.join(out_dir, name + ext)
        if os.path.exists(old):
            os.replace(old, os.path.join(out_dir, f"{name}.{stamp}{ext}"))
    print(f"note: {out_dir} held a checkpoint of another run; moved it to "
          f"ckpt.{stamp}.pt (and its log to log.{stamp}.jsonl)", flush=True)


def start_log(log_path, resumed, start_iter):
    """A new run starts a new log. A resumed one drops the evaluations logged after its
    checkpoint (a crash between the two): it logs them again. The log is not the run's state:
    a line a crash cut short is dropped with a warning, and a log that cannot be written costs
    a warning, never the run."""
    try:
        if not resumed:
            open(log_path, "w").close()
            return
        if not os.path.exists(log_path):
            return
        kept, unreadable = [], 0
        with open(log_path, errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                    it = row["iter"]
                except (ValueError, TypeError, KeyError):
                    unreadable += bool(line.strip())
                    continue
                if it <= start_iter:
                    kept.append(line if line.endswith("\n") else line + "\n")
        if unreadable:
            print(f"warning: {log_path}: dropped {unreadable} unreadable line(s) (a write cut "
                  f"short by a crash?)", flush=True)
        with open(log_path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(log_path + ".tmp", log_path)
    except OSError as e:
        print(f"warning: cannot rewrite {log_path} ({e.strerror}); training goes on", flush=True)


def append_log(log_path, record):
    """One line more in log.jsonl. A write that fails (a full disk) is cut back off, so no half
    line is left for the next one to be glued to; the OSError is the caller's to report."""
    size = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    try:
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:
        with contextlib.suppress(OSError):
            os.truncate(log_path, size)
        raise


# ----------------------------------------------------------------------------------------
# the CPU's peak, which CPU MFU is measured against (a CPU has no honest datasheet number)

def time_matmul(dtype, seconds=0.2, bursts=4):
    """FLOP/s of a 1024^3 matmul in `dtype` on this process's threads: the best of a few short
    bursts, so that a moment of load from other processes does not end up in the cache."""
    a = torch.randn(1024, 1024, dtype=dtype)
    a @ a  # warm up
    best = 0.0
    for _ in range(bursts):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / bursts:
            a @ a
            calls += 1
        best = max(best, 2 * 1024 ** 3 * calls / (time.perf_counter() - t0))
    return best


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cached_cpu_peak(dtype):
    """time_matmul's rate, timed once per CPU model, thread count, dtype and torch version and
    kept in ~/.cache/roformer/cpu_peak.json (delete it to time again): a short run should not
    pay for the probe every time."""
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                         "roformer", "cpu_peak.json")
    key = f"{cpu_model()} | {torch.get_num_threads()} threads | {dtype} | torch {torch.__version__}"
    try:
        with open(cache) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    if not isinstance(table, dict) or not isinstance(table.get(key), float):
        table = table if isinstance(table, dict) else {}
        table[key] = time_matmul(dtype)
        with contextlib.suppress(OSError):  # a read-only home: time it again next run
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            with open(f"{cache}.{os.getpid()}.tmp", "w") as f:
                json.dump(table, f, indent=1)
            os.replace(f"{cache}.{os.getpid()}.tmp", cache)
    return table[key]


def cpu_peak_flops(dtype, ddp):
    """One process's CPU peak in `dtype`. Under DDP rank 0 times it alone and shares it: ranks
    timing at once on shared cores would each measure a fraction of the peak."""
    peak = torch.zeros((), dtype=torch.float64)
    if not ddp or torch.distributed.get_rank() == 0:
        peak.fill_(cached_cpu_peak(dtype))
    if ddp:
        torch.distributed.broadcast(peak, src=0)
    return peak.item()
