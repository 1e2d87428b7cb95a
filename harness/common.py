"""What every script shares: the one user-error type and the one place it becomes a line
(`error: ...`, exit 1, after undoing the empty folders the command made), and the repo root.
Imports nothing of the project (harness/torchrun_errors.py only lazily, under torchrun), nor torch
(data/'s workers import this)."""
import atexit
import functools
import gc
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class UserError(Exception):
    """A mistake the user can fix (a flag, a path, a file): one line `error: ...`, exit 1."""


created_dirs = []  # folders this command made: a failure removes them again while empty
created_files = []  # files that mean nothing once it fails (train.py's out_dir lock)


def error_line(msg):
    """The one form a user error takes: the line `error: msg`."""
    return f"error: {msg}"


def cleanup():
    """What a failed command undoes before it says why: no empty folder it made is left behind
    (empty but for its created_files)."""
    for d in created_dirs:
        if os.path.isdir(d) and all(os.path.join(d, f) in created_files for f in os.listdir(d)):
            shutil.rmtree(d, ignore_errors=True)


held = []  # hold_collections turned the garbage collector off (until release_collections)


def hold_collections():
    """Start-up and exit without Python's full garbage collections, where they are waste. The
    imports (torch, and torch._dynamo, which torch.optim's first step imports) leave hundreds
    of thousands of objects that live as long as the process, and Python walks them all again
    every so many new ones; its exit walks them once more before the process frees its memory
    anyway (what each costs: docs/SPEED.md). So collections are off
    until release_collections (train.py: before its loop), and at exit gc.freeze takes every
    object out of them. Only where the caller's script is the process itself (`python
    train.py`, torchrun's workers): a test that runs train.py inside its own process keeps its
    collections. Nothing the run writes waits on a finaliser: its files are closed as they are
    written, and the interpreter flushes stdout and stderr itself."""
    if sys._getframe(1).f_back is None:  # the caller runs at the process's top level
        held.append(True)
        gc.disable()
        atexit.unregister(gc.freeze)
        atexit.register(gc.freeze)


def release_collections():
    """hold_collections' end: what start-up built lives to the end, so it is frozen (later
    collections skip it, the loop's too), and collections go on for what comes after."""
    if held:
        held.clear()
        gc.freeze()
        gc.enable()


def excepthook(kind, value, tb):
    """sys.excepthook of a script without a main (train.py): a UserError is its line, exit 1
    (under torchrun once, by the first rank that hits it: harness/torchrun_errors.py)."""
    if issubclass(kind, UserError):
        cleanup()
        line = error_line(value)
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # under torchrun only
            from harness.torchrun_errors import said_by_another_rank
            if said_by_another_rank(line):
                return
        print(line, file=sys.stderr, flush=True)
    else:
        sys.__excepthook__(kind, value, tb)


def cli(main, interrupted=130):
    """A script's main(argv), a UserError ending as its line and Ctrl-C as exit `interrupted`
    (a code, or a message)."""
    @functools.wraps(main)
    def run(argv=None):
        try:
            return main(sys.argv[1:] if argv is None else argv)
        except UserError as e:
            cleanup()
            sys.exit(error_line(e))
        except KeyboardInterrupt:
            sys.exit(interrupted)
    return run
