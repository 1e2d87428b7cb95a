"""log.jsonl, the run's log: started empty by a new run, one line per evaluation. The log is not
the run's state: a write that fails costs a warning."""
import contextlib
import json
import os


def new_log(log_path):
    """A new run starts an empty log.jsonl (one that crashed before its first checkpoint may
    have left one). The log is not the run's state: failing to write it costs a warning."""
    try:
        open(log_path, "w").close()
    except OSError as e:
        print(f"warning: cannot write {log_path} ({e.strerror}); training goes on", flush=True)


def append_log(log_path, record, warn=print):
    """One line more in log.jsonl. The log is not the run's state: a write that fails (a full
    disk) is cut back off, so no half line is left for the next one to be glued to, and costs
    a warning, not the checkpoint."""
    size = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    try:
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        with contextlib.suppress(OSError):
            os.truncate(log_path, size)
        warn(f"warning: cannot write {log_path} ({e.strerror}): the evaluation at iteration "
             f"{record['iter']} is not logged")
