"""Stage 4: the workers, which take batches from the main process (documents.tasks) in order:
`scan` (pass 1: validate, count, draw tokenizer sample candidates) and `encode` (pass 2: token
ids, each document finished by the end-of-document id)."""
import collections
import concurrent.futures
import itertools
import os
import signal

import numpy as np

from data import documents as docs_stage
from data.shared import EOS_ID, cut_point, mix64
from data.tokenizer import load_tokenizer

UNIT_CHARS = 1 << 14      # the tokenizer sample is drawn in units of at most this size


def default_num_proc():
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:
        return os.cpu_count() or 1


def cpu_seconds():
    """CPU time of this process and of its finished children (the workers), user + system."""
    import resource  # Unix only, as is the split's os.pread
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def ordered_map(fn, jobs, num_proc, settings):
    """fn over jobs in num_proc worker processes (each set up by init_worker(settings)), results
    in the order of the jobs. At most a few jobs are in flight, so a fast reader cannot queue
    up the whole corpus in memory. When the reader stops early (an error in a batch), the jobs
    not started are dropped and the running ones finish: multiprocessing.Pool's terminate()
    could kill a worker while it held the result pipe's lock and hang (seen under load)."""
    if num_proc <= 1:
        init_worker(settings)
        yield from map(fn, jobs)
        return
    with concurrent.futures.ProcessPoolExecutor(num_proc, initializer=start_worker,
                                                initargs=(settings,)) as pool:
        window = collections.deque()
        try:
            for job in jobs:
                window.append(pool.submit(fn, job))
                if len(window) >= 2 * num_proc + 2:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        finally:
            for future in window:
                future.cancel()


# This worker process's settings (text fields, undecodable, seed; encode: tokenizer, dtype).
_worker = {}


def start_worker(settings):
    """A worker process's start: Ctrl-C reaches the whole process group, and the main process
    alone handles it (it stops the pool and says one line), so a worker ignores it rather than
    print a KeyboardInterrupt traceback of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init_worker(settings)


def init_worker(settings):
    _worker.clear()
    _worker.update(settings)
    if "model" in settings:
        _worker["sp"] = load_tokenizer(settings["model"])


def _batch_documents(kind, name, items, stats):
    """The batch's documents (documents.documents), counted in stats as they pass."""
    for loc, text, _, last in docs_stage.documents(
            kind, name, items, _worker["text_fields"], _worker["undecodable"] == "skip", stats):
        stats["docs"] += last
        stats["bytes"] += len(text) if text.isascii() else len(text.encode("utf-8"))
        yield loc, text, last


def scan(job):
    """Pass 1 on one batch: counts, U+2581 check, and sample candidates with keys < cutoff."""
    (kind, si, name, items), cutoff = job
    stats = {"docs": 0, "bytes": 0, "skipped": 0, "no_field": 0, "marker": None, "error": None,
             "source": si, "pid": os.getpid()}
    units, locs = [], []
    for loc, text, _ in _batch_documents(kind, name, items, stats):
        if stats["marker"] is None and "\u2581" in text:
            stats["marker"] = f"{name} at {loc}"
        sub = 0
        while text:
            i = cut_point(text, UNIT_CHARS) if len(text) > UNIT_CHARS else len(text)
            units.append(text[:i])
            locs.append((loc << 16) + sub)
            text, sub = text[i:], sub + 1
    keys = mix64(mix64(_worker["seed"], si), np.array(locs, dtype=np.uint64)) if units else []
    stats["sample"] = [(int(k), si, u) for k, u in zip(keys, units) if int(k) < cutoff]
    return stats


def encode(job):
    """Pass 2 on one batch: the token ids of its documents, each finished by EOS."""
    kind, si, name, items = job
    sp, dtype = _worker["sp"], _worker["dtype"]
    stats = {"docs": 0, "bytes": 0, "skipped": 0, "error": None, "pid": os.getpid()}
    texts, ends = [], []
    for _, text, last in _batch_documents(kind, name, items, stats):
        while len(text) > docs_stage.PIECE_CHARS:  # a long JSON record or parquet value
            i = cut_point(text, docs_stage.PIECE_CHARS)
            texts.append(text[:i])
            ends.append(False)
            text = text[i:]
        texts.append(text)
        ends.append(last)
    ids = sp.encode(texts) if texts else []
    for piece, end in zip(ids, ends):
        if end:
            piece.append(EOS_ID)
    flat = itertools.chain.from_iterable(ids)  # iterated in C, not token by token in Python
    stats["tokens"] = np.fromiter(flat, dtype=dtype, count=sum(map(len, ids)))
    return stats
