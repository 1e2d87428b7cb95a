"""
Preparing the default corpus (this Python's stdlib), end to end, and encoding throughput.

    python bench/prepare.py                 # full prepare into a temp folder + encoder table
    python bench/prepare.py --encode_mb 4   # smaller encoding slice

Part 1 runs `python data/pystdlib/prepare.py --out_dir TMP` as a fresh process and reports its
wall time, its phases (from its log) and its peak RSS. Part 2 encodes the same slice of the
stdlib with the tokenizer part 1 trained, three ways: one call per document on one thread,
sentencepiece's batch encode on its C++ threads (what data/common.py does), and a
multiprocessing pool of the same size. Quote the ratios: the machine is shared and noisy.
"""
import argparse
import multiprocessing as mp
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

import sentencepiece as spm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_sp = None


def _init(model_path):
    global _sp
    _sp = spm.SentencePieceProcessor(model_file=model_path)


def _encode(text):
    return _sp.encode(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--encode_mb", type=float, default=8.0, help="size of the slice for part 2")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3, help="part 2: best of this many runs")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "pystdlib")
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, os.path.join(REPO, "data", "pystdlib", "prepare.py"),
                            "--out_dir", out], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            sys.exit(f"error: prepare failed: {r.stderr.strip()}")
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        log = r.stdout
        docs_mb = re.search(r"(\d+) documents, ([\d.]+) MB", log)
        tok_s = float(re.search(r"tokenizer trained in ([\d.]+)s", log).group(1))
        enc = float(re.search(r"encoding ([\d.]+) MB/s", log).group(1))
        bpt = float(re.search(r"([\d.]+) bytes/token", log).group(1))
        tokens = re.search(r"train ([\d,]+) tokens.*val ([\d,]+) tokens", log)
        print(f"# python data/pystdlib/prepare.py on {os.cpu_count()} cores "
              f"(Python {sys.version.split()[0]}, sentencepiece {spm.__version__}, "
              f"load average before: {load0:.1f})")
        print("| documents | MB | train tokens | val tokens | bytes/token | tokenizer s "
              "| encoding MB/s | total s | peak RSS MiB |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {docs_mb.group(1)} | {float(docs_mb.group(2)):.1f} | {tokens.group(1)} "
              f"| {tokens.group(2)} | {bpt:.2f} | {tok_s:.1f} | {enc:.1f} | {wall:.1f} "
              f"| {rss:.0f} |")

        # Part 2: the same documents, encoded three ways.
        from importlib.util import module_from_spec, spec_from_file_location
        spec = spec_from_file_location("pystdlib_prepare",
                                       os.path.join(REPO, "data", "pystdlib", "prepare.py"))
        mod = module_from_spec(spec)
        spec.loader.exec_module(mod)
        docs, _, _ = mod.stdlib_documents()
        texts, size = [], 0
        for _, load in docs:
            if size >= a.encode_mb * 1e6:
                break
            texts.append(load())
            size += len(texts[-1].encode("utf-8"))
        model = os.path.join(out, "tokenizer.model")
        sp = spm.SentencePieceProcessor(model_file=model)

        def timed(fn):
            t = time.perf_counter()
            n = fn()
            return time.perf_counter() - t, n

        # Interleaved repetitions, best of --reps for each: the machine is shared.
        methods = [
            ("one call per document, 1 thread", lambda: sum(len(sp.encode(x)) for x in texts)),
            (f"batch encode, {a.threads} sentencepiece threads (used)",
             lambda: sum(map(len, sp.encode(texts, num_threads=a.threads)))),
            (f"multiprocessing pool, {a.threads} processes",
             lambda: sum(map(len, pool.imap(_encode, texts, chunksize=8)))),
        ]
        best = {}
        with mp.Pool(a.threads, initializer=_init, initargs=(model,)) as pool:
            for _ in range(a.reps):
                for name, fn in methods:
                    t, n = timed(fn)
                    best[name] = min(best.get(name, (t, n)), (t, n))
        rows = [(name, *best[name]) for name, _ in methods]
        assert len({n for _, _, n in rows}) == 1, "all three give the same tokens"
        print(f"\n# encoding {size / 1e6:.1f} MB ({len(texts)} stdlib files), same tokenizer, "
              f"best of {a.reps}; load average now: {os.getloadavg()[0]:.1f}")
        print("| method | s | MB/s | vs 1 thread |")
        print("|---|---:|---:|---:|")
        for name, t, n in rows:
            print(f"| {name} | {t:.2f} | {size / 1e6 / t:.2f} | {rows[0][1] / t:.2f}x |")


if __name__ == "__main__":
    main()
