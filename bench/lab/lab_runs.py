"""The run helpers bench/studies/ablation.py and bench/compare.py share: a train.py run folder's
log, whether a finished run can be reused (by a key of everything that decides it; for
ablation.py, its command), a folder name that says what a run is, a command run with its
output logged, progress over many runs, atomic text, CSV and figure writes, and pyplot where
installed; and the code versions compare's arms run (a git revision, the working tree, a
patch)."""
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

from tqdm import tqdm

from harness.common import UserError  # the importers put the repo root on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_csv(path, rows, fields):
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    write_atomic(path, buf.getvalue())



def read_log(run_dir):
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def stale(run_dir, key, max_iters):
    """Why the run in run_dir cannot be reused for `key` (what decides the run: {part: value},
    written to run_key.json once it finished), or None when it can. A folder without a key is
    an interrupted run (the key is written last)."""
    try:
        with open(os.path.join(run_dir, "run_key.json")) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return "interrupted" if os.path.isdir(run_dir) else "new"
    changed = [changed_part(part, old.get(part), key[part]) for part in key
               if old.get(part) != key[part]]
    if changed:
        return "its " + ", ".join(changed) + " changed since it was trained"
    log = read_log(run_dir)
    if not (os.path.exists(os.path.join(run_dir, "ckpt.pt")) and log
            and log[-1]["iter"] >= max_iters):
        return "interrupted"
    return None


def changed_part(part, old, new):
    """A key's part that changed, with the files that changed where it holds file hashes (the
    code: 'code (model.py)'), so that a retrain says which edit caused it."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return part
    files = sorted(f for f in old.keys() | new.keys() if old.get(f) != new.get(f))
    return f"{part} ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''})"


def folder_name(identity, label):
    """A run folder's name from what the run is, not where it stands in a list: a readable slug
    of label and a hash of identity (so two arms whose slugs agree still differ)."""
    slug = re.sub(r"[^A-Za-z0-9_.]+", "-", label).strip("-")[:40] or "arm"
    return f"{slug}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}"


class RunsProgress:
    """Iterations over a list of runs, as they train: a tqdm bar on a terminal, else a plain
    line at most every `every` seconds, with an estimate of the time left for all the runs;
    and each silent step of a run (phase) as it starts."""

    def __init__(self, n_runs, max_iters, every=10.0):
        self.n_runs, self.max_iters, self.every = n_runs, max_iters, every
        self.done, self.trained_iters, self.t_train, self.said = 0, 0, 0.0, 0.0
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=n_runs * max_iters, unit="it", dynamic_ncols=True,
                        disable=not self.tty)
        self.what, self.it, self.t_run = "", 0, time.time()

    def start(self, k, what):
        self.what, self.it, self.t_run = f"run {k + 1}/{self.n_runs}: {what}", 0, time.time()
        self.bar.set_description(self.what)
        self.said = 0.0  # a plain line as each run starts, then every `every` seconds

    def phase(self, text):
        """The run in flight starts a step that prints nothing for seconds (train.py's start,
        eval.py's scoring): said at once, on the bar or as a line."""
        self.bar.set_description(f"{self.what}: {text}")
        if not self.tty:
            print(f"{self.what}: {text}", flush=True)

    def at(self, it):
        """The run in flight is at iteration it."""
        self.it = min(max(it, self.it), self.max_iters)
        self.bar.update(self.done + self.it - self.bar.n)
        now = time.time()
        if not self.tty and now - self.said >= self.every:
            self.said = now
            iters = self.trained_iters + self.it
            left = self.n_runs * self.max_iters - self.done - self.it
            line = f"{self.what}: iteration {self.it}/{self.max_iters}"
            if iters:
                eta = int((self.t_train + now - self.t_run) / iters * left)
                line += f", eta {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d} for all runs"
            print(line, flush=True)

    def end(self, trained):
        """The run in flight ended (trained: it ran here; else it was reused or skipped)."""
        if trained:
            self.trained_iters += self.max_iters
            self.t_train += time.time() - self.t_run
        self.done += self.max_iters
        self.it = 0
        self.bar.update(self.done - self.bar.n)

    def write(self, line):
        self.bar.write(line)

    def close(self):
        self.bar.close()


# ----------------------------------------------------------------------------------------
# code versions (compare's arms): each made once under OUT/code/; the checkout is only read

def git(*cmd, **kw):
    return subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, check=True, **kw).stdout


def materialise(dest, fill):
    """The folder dest, filled once by fill(folder) (into a temporary folder, then renamed)."""
    if not os.path.isdir(dest):
        tmp = dest + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        fill(tmp)
        os.replace(tmp, dest)
    return dest


def revision_code(out, rev):
    try:
        sha = git("rev-parse", "--verify", "--quiet", rev + "^{commit}", text=True).strip()
    except (subprocess.CalledProcessError, OSError):
        raise UserError(f"--against={rev}: not a git revision of {ROOT}") from None
    tar = git("archive", "--format=tar", sha)
    # the "data" filter where this Python has it (newer ones warn without a filter)
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    return materialise(os.path.join(out, "code", "rev-" + sha[:12]),
                       lambda d: tarfile.open(fileobj=io.BytesIO(tar)).extractall(d, **safe))


# What no train.py or eval.py run reads: left out of a working tree's copy and of every code
# version's identity, so that an edit there (a test, a doc, the lab itself) retrains nothing. A
# file a run does read, left out, fails that run loudly (not found), never silently.
NOT_READ_DIRS = {"tests", "docs", "bench", ".ci", ".git", "__pycache__"}
NOT_READ_SUFFIXES = (".md", ".png", ".pyc")


def run_reads(path):
    """Whether a run may read `path` (relative to the code's root, '/'-separated)."""
    parts = path.split("/")
    return not (set(parts[:-1]) & NOT_READ_DIRS or parts[0] in NOT_READ_DIRS
                or path.endswith(NOT_READ_SUFFIXES))


def inside(path, folder):
    """Whether path lies in folder (both absolute)."""
    return os.path.commonpath([path, folder]) == folder


def worktree_code(out):
    """A copy of the working tree as it is now (tracked and untracked files git does not
    ignore, less what no run reads and --out's own files, which sit in the tree when --out does
    and are not ignored), named by a hash of the contents: an edit makes a new copy."""
    try:
        listed = git("ls-files", "-z", "-co", "--exclude-standard", text=True).split("\0")
    except (subprocess.CalledProcessError, OSError):
        return ROOT  # not a git checkout: the tree itself
    out = os.path.abspath(out)
    files = sorted(f for f in listed if f and run_reads(f)
                   and os.path.isfile(os.path.join(ROOT, f))
                   and not inside(os.path.join(ROOT, f), out))
    name = "tree-" + manifest_hash(file_hashes(ROOT, files))

    def copy(d):
        for f in files:
            os.makedirs(os.path.dirname(os.path.join(d, f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(d, f))
    return materialise(os.path.join(out, "code", name), copy)


def file_hashes(root, files):
    """{file: a hash of its bytes} for the files (relative to root)."""
    hashes = {}
    for f in files:
        with open(os.path.join(root, f), "rb") as fh:
            hashes[f] = hashlib.sha256(fh.read()).hexdigest()[:16]
    return hashes


def manifest_hash(hashes):
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()[:12]


def content(root, name):
    """The bytes of root/name, None if there is no such file."""
    path = os.path.join(root, name)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    return None


def patched_code(out, base_code, patch):
    """base_code with `patch` applied; a patch that does not apply is a UserError (its arm
    only)."""
    path = os.path.abspath(patch)
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise UserError(f"cannot read the patch {patch}: {e.strerror}") from None
    name = f"{os.path.basename(base_code)}+{hashlib.sha256(text).hexdigest()[:12]}"

    def fill(d):
        shutil.copytree(base_code, d, dirs_exist_ok=True)
        # Inside another repository (an --out in a checkout, as the default is) git apply
        # reads the patch's paths from that repository's root, skips them all and exits 0:
        # a patch arm that silently runs the base. So git looks no higher than the copy.
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(os.path.abspath(d)))
        r = subprocess.run(["git", "apply", "--numstat", "--apply", path], cwd=d, env=env,
                           capture_output=True, text=True)  # the files it names, and applied
        names = [line.split("\t")[-1] for line in r.stdout.splitlines()]
        if r.returncode or all(content(d, n) == content(base_code, n) for n in names):
            shutil.rmtree(d, ignore_errors=True)
            why = (r.stderr.strip().splitlines() or ["git apply changed no file"])[-1]
            raise UserError(f"the patch {patch} does not apply: {why}")
    return materialise(os.path.join(out, "code", name), fill)


def code_identity(code, skip=None):
    """What identifies a code version: {file: hash} of the files its runs read (so a retrain
    can name the file that changed), walked in its copy; for a tree that is not a git checkout
    (run in place) its Python files, less the folder `skip` (--out, when it lies inside)."""
    in_place, found = code == ROOT, []
    for d, dirs, files in os.walk(code):  # top-down: the folders left out are not entered
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and not (
            skip and inside(os.path.join(d, x), os.path.abspath(skip))))
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), code).replace(os.sep, "/")
            if run_reads(rel) and (f.endswith(".py") or not in_place):
                found.append(rel)
    return file_hashes(code, sorted(found))


# ----------------------------------------------------------------------------------------
# running a command

def last_error(path):
    """The line a failed command ends with: its `error: ...` line, else its last line."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return "no output"
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or ["no output"])[-1].removeprefix("error: ")


def run_logged(cmd, cwd, out_path, on_line=None, env=None):
    """Run cmd with its output in out_path, each line also to on_line as it comes (progress);
    returns (exit code, peak RSS in MiB)."""
    with open(out_path, "w") as f:
        p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, errors="replace", env=env)
        for line in p.stdout:
            f.write(line)
            if on_line:
                on_line(line.rstrip("\n"))
        p.stdout.close()
        _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, usage.ru_maxrss / 1024  # Linux: KiB


def iteration_of(line):
    """The iteration a train.py output line reports ('iter N/M: ...', 'iter N: ...'), or None."""
    m = re.match(r"iter (\d+)\b", line)
    return int(m.group(1)) if m else None


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
