"""One user error under torchrun, said once (harness/common.excepthook imports this only there).
Imports nothing of the project."""
import datetime
import hashlib
import os


def said_by_another_rank(line):
    """Under torchrun every rank mostly hits the same mistake (a flag, a path): the first rank
    to count the line in the launcher's store says it and the others stay quiet, so each
    distinct line appears once, whichever rank hit it (one that only rank 3 hits is still
    said). Without that store, or if it does not answer, every rank speaks: a line said twice
    beats a line lost."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    try:
        from torch.distributed import TCPStore
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=datetime.timedelta(seconds=5))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        key = f"roformer-error/{attempt}/{hashlib.sha256(line.encode()).hexdigest()}"
        return store.add(key, 1) > 1
    except Exception:  # noqa: BLE001 - any failure to ask: say it
        return False
