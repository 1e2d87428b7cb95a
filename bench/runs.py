"""The run helpers bench/ablation.py and bench/compare.py share: a train.py run folder's
log, whether a finished run can be reused, atomic text and figure writes, and pyplot where
installed."""
import json
import os


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_log(run_dir):
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def finished(run, cmd, max_iters):
    """A run can be reused if it ran this exact command to the end."""
    try:
        with open(os.path.join(run["dir"], "ablation_cmd.json")) as f:
            same = json.load(f) == cmd[1:]  # not the interpreter's path
    except (OSError, ValueError):
        return False
    log = read_log(run["dir"])
    return (same and os.path.exists(os.path.join(run["dir"], "ckpt.pt"))
            and bool(log) and log[-1]["iter"] >= max_iters)


def pyplot():
    """matplotlib's pyplot drawing to files, or None (said in one line) where it is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib for one)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(plt, fig, path, dpi):
    """Write fig to path atomically (a temp file, then a rename) and close it; returns path."""
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=dpi)
    os.replace(path + ".tmp.png", path)
    plt.close(fig)
    return path
