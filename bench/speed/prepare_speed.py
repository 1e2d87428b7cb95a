"""
data/text/prepare.py on a large synthetic corpus: throughput, peak memory, and the ceiling.

    python bench/speed/prepare_speed.py                        # 2 GB corpus (the default --size)
    python bench/speed/prepare_speed.py --size 200M --forms txt jsonl.gz parquet

The corpus is made here (no download) in --workdir and kept for the next run: documents of
pseudo-words with a Zipf-like frequency, lines and paragraphs, about 3 KB each, written
three ways: one single .txt file (documents = paragraphs), a folder of .jsonl.gz shards and
a folder of parquet shards, each shard holding about 1/16 of the text. Each form is
prepared at 1/4, 1/2 and the full size (the first shards, or the first part of the .txt) in
a fresh process with --num_proc N (default: every core); the table gives the wall time of
each stage, MB/s of text and tokens/s, and the peak memory of the whole process tree (the
sum of PSS, so pages the workers share with the parent count once), sampled every 0.1 s.
The text form is also prepared at 1/4 size with one process (1 vs N).

The ceiling: sentencepiece's own encode(list, num_threads=N) on --ceiling_mb of the same
documents held in memory, with the tokenizer the full-size text run trained; the pipeline's
encoding pass (reading, parsing, encoding, writing) is set against it. Quote the ratios: the
machine is shared and noisy.
"""
import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARDS = 16


def parse_size(s):
    m = re.fullmatch(r"([\d.]+)\s*([kKmMgG]?)B?", s)
    if not m:
        sys.exit(f"error: --size {s!r} is not a size like 2G, 500M or 123456")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()])


def documents(size, seed=0):
    """Synthetic documents, about `size` bytes in all, in lists of about 8 MB."""
    rng = np.random.default_rng(seed)
    syl = np.array("ka lo mi ne ra tu se po an ed in th er qu or ly ba ce di fo gu he ja ki "
                   "mo nu pe ri so ta ve wi xo yu ze al en ic on us".split())
    lens = rng.integers(1, 4, 30000)
    words = np.array(["".join(rng.choice(syl, n)) for n in lens])
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.05
    p /= p.sum()
    words = np.concatenate([words, [".\n", ",", "\n\n"]])  # line ends, commas, document ends
    p = np.concatenate([p * 0.88, [0.07, 0.045, 0.005]])
    done = 0
    while done < size:
        w = words[rng.choice(len(words), 1_400_000, p=p)]
        text = " ".join(w).replace(" .\n ", ".\n").replace(" , ", ", ")
        docs = [d.strip(" ") for d in text.split(" \n\n ")][1:-1]  # whole documents only
        done += sum(map(len, docs)) + 2 * len(docs)
        yield docs


def make_corpus(workdir, size, forms):
    """workdir/{corpus.txt, jsonl.gz/, parquet/} (the forms asked for; the .txt always);
    returns {form: [(fraction, inputs)]}."""
    done_flag = os.path.join(workdir, "done-" + "-".join(sorted(forms)))
    txt = os.path.join(workdir, "corpus.txt")
    if not os.path.exists(done_flag):
        t0 = time.time()
        cuts = write_corpus(workdir, txt, size, forms)
        for frac, at in cuts.items():  # corpus-FRAC.txt: the .txt's first FRAC
            part = os.path.join(workdir, f"corpus-{frac}.txt")
            with open(txt, "rb") as src, open(part, "wb") as dst:
                left = at
                while left:
                    left -= dst.write(src.read(min(left, 64 << 20)))
        open(done_flag, "w").close()
        print(f"# made the corpus in {time.time() - t0:.0f}s", flush=True)

    inputs = {}
    for form in set(forms) - {"txt"}:
        shards = sorted(os.path.join(workdir, form, f) for f in os.listdir(os.path.join(workdir, form)))
        inputs[form] = [(frac, shards[:max(1, int(len(shards) * frac))])
                        for frac in (0.25, 0.5, 1.0)]
    inputs["txt"] = [(frac, [os.path.join(workdir, f"corpus-{frac}.txt")]) for frac in (0.25, 0.5)]
    inputs["txt"].append((1.0, [txt]))
    return inputs


def write_corpus(workdir, txt, size, forms):
    """size bytes of documents into txt and, in SHARDS shards, the other forms asked for;
    returns {fraction: byte offset of the .txt at the document boundary where that fraction
    of the shards ends}."""
    os.makedirs(os.path.join(workdir, "jsonl.gz"), exist_ok=True)
    os.makedirs(os.path.join(workdir, "parquet"), exist_ok=True)
    shard_size, cuts = size / SHARDS, {}
    with open(txt, "w", encoding="utf-8") as ft:
        shard, shard_docs, shard_bytes, written = 0, [], 0, 0

        def flush():
            nonlocal shard, shard_docs, shard_bytes
            name = f"shard{shard:03d}"
            if "jsonl.gz" in forms:
                with gzip.open(os.path.join(workdir, "jsonl.gz", name + ".jsonl.gz"), "wt",
                               encoding="utf-8", compresslevel=6) as f:
                    f.writelines(json.dumps({"id": i, "text": d}) + "\n"
                                 for i, d in enumerate(shard_docs))
            if "parquet" in forms:
                import pyarrow as pa
                import pyarrow.parquet as pq
                pq.write_table(pa.table({"text": shard_docs}),
                               os.path.join(workdir, "parquet", name + ".parquet"),
                               row_group_size=2000)
            shard, shard_docs, shard_bytes = shard + 1, [], 0
        for d in (d for docs in documents(size) for d in docs):
            if written >= size:
                break
            ft.write(d + "\n\n")
            written += len(d) + 2
            shard_docs.append(d)
            shard_bytes += len(d) + 2
            if shard_bytes >= shard_size:
                flush()
                for frac in (0.25, 0.5):
                    if shard == int(SHARDS * frac):
                        cuts[frac] = written
        if shard_docs:
            flush()
    return cuts


def tree_pss(root):
    """The proportional set size of root and its descendants, in bytes."""
    parents = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    parents[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, total = {root}, 0
    changed = True
    while changed:
        changed = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                changed = True
    for pid in tree:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


def run_prepare(inputs, out_dir, num_proc, extra):
    cmd = [sys.executable, os.path.join(REPO, "data", "text", "prepare.py"), "--input", *inputs,
           "--out_dir", out_dir, "--num_proc", str(num_proc), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_pss(proc.pid))
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    out, err = proc.communicate()
    if proc.returncode:
        sys.exit(f"error: prepare failed: {err.strip()}")
    num = lambda pattern: float(re.search(pattern, out).group(1).replace(",", ""))
    meta = json.load(open(os.path.join(out_dir, "meta.json")))
    return dict(wall=wall, peak=peak, mb=meta["source_bytes"] / 1e6,
                tokens=meta["train_tokens"] + meta["val_tokens"],
                scan=num(r"scanned in ([\d.]+)s"), tok=num(r"tokenizer trained in ([\d.]+)s"),
                enc_mbs=num(r"encoding ([\d.]+) MB/s"), enc_cpu=num(r"\(([\d.]+) CPU s\)"),
                split=num(r"split ([\d.]+)s"))


def ceiling(model, docs, mb, num_proc):
    """sentencepiece's own batch encode on its C++ threads: (MB/s, MB per CPU second)."""
    import resource
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=model)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    sp.encode(docs, num_threads=num_proc)
    r1, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    return mb / t, mb / cpu


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="2G", help="corpus size (text bytes): 2G, 500M, ...")
    ap.add_argument("--workdir", default=os.path.join("/tmp", "roformer-bench-prepare"))
    ap.add_argument("--forms", nargs="+", default=["txt", "jsonl.gz", "parquet"],
                    choices=["txt", "jsonl.gz", "parquet"])
    ap.add_argument("--num_proc", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--vocab_size", type=int, default=8192)
    ap.add_argument("--ceiling_mb", type=float, default=64.0,
                    help="text encoded in memory for the ceiling")
    ap.add_argument("--no_single", action="store_true", help="skip the 1-process run")
    return ap.parse_args()


def first_documents(mb_wanted):
    """The corpus's first documents, about mb_wanted MB of them, for the ceiling: (docs, MB)."""
    docs, mb = [], 0.0
    for d in (d for batch in documents(int(mb_wanted * 1e6)) for d in batch):
        if mb >= mb_wanted:
            break
        docs.append(d)
        mb += len(d) / 1e6
    return docs, mb


def main():
    a = parse_args()
    import sentencepiece as spm

    size = parse_size(a.size)
    workdir = os.path.join(a.workdir, str(size))
    forms = make_corpus(workdir, size, a.forms)
    docs, mb = first_documents(a.ceiling_mb)
    extra = ["--vocab_size", str(a.vocab_size)]
    print(f"# data/text/prepare.py, synthetic corpus of {size / 1e9:.2f} GB, {os.cpu_count()} "
          f"cores, --num_proc {a.num_proc}, vocab {a.vocab_size}, sentencepiece "
          f"{spm.__version__}; load average before: {os.getloadavg()[0]:.1f}")
    print(f"# ceiling: encode(list, num_threads={a.num_proc}) on {mb:.0f} MB of the corpus in "
          f"memory, with the run's tokenizer, right after each run")
    print("| form | size | procs | MB | Mtokens | scan s | tokenizer s | encode MB/s | split s "
          "| total s | MB/s | Mtok/s | peak MiB | ceiling MB/s | encode / ceiling "
          "| whole run / ceiling | encode CPU efficiency |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
          flush=True)
    rows = {}
    runs = [(form, frac, inputs, a.num_proc) for form in a.forms for frac, inputs in forms[form]]
    if not a.no_single and "txt" in a.forms:
        runs.append(("txt", 0.25, forms["txt"][0][1], 1))
    for form, frac, inputs, n in runs:
        out = os.path.join(workdir, f"out-{form}-{frac}-{n}")
        r = run_prepare(inputs, out, n, extra)
        ceil, ceil_cpu = ceiling(os.path.join(out, "tokenizer.model"), docs, mb, n)
        rows[form, frac, n] = r
        print(f"| {form} | {frac:g} | {n} | {r['mb']:.0f} | {r['tokens'] / 1e6:.1f} | "
              f"{r['scan']:.1f} | {r['tok']:.1f} | {r['enc_mbs']:.2f} | {r['split']:.1f} | "
              f"{r['wall']:.0f} | {r['mb'] / r['wall']:.2f} | {r['tokens'] / 1e6 / r['wall']:.2f} "
              f"| {r['peak'] / 2**20:.0f} | {ceil:.2f} | {r['enc_mbs'] / ceil:.0%} "
              f"| {r['mb'] / r['wall'] / ceil:.0%} | {r['mb'] / r['enc_cpu'] / ceil_cpu:.0%} |",
              flush=True)
        shutil.rmtree(out)
    print(f"# load average now: {os.getloadavg()[0]:.1f}. encode: the encoding pass (read, "
          f"parse, encode, write); encode CPU efficiency: MB per CPU second of that pass (all "
          f"processes) against the ceiling's")
    growth(a, rows)


def growth(a, rows):
    """The peak memory at 1/2 and the whole corpus against 1/4, per form, and one process
    against --num_proc."""
    print("\n| form | peak at 1/2 vs 1/4 | peak at full vs 1/4 |")
    print("|---|---:|---:|")
    for form in a.forms:
        q = rows[form, 0.25, a.num_proc]["peak"]
        print(f"| {form} | {rows[form, 0.5, a.num_proc]['peak'] / q:.2f}x "
              f"| {rows[form, 1.0, a.num_proc]['peak'] / q:.2f}x |")
    if ("txt", 0.25, 1) in rows:
        one, many = rows["txt", 0.25, 1], rows["txt", 0.25, a.num_proc]
        print(f"\n# txt at 1/4 size: {a.num_proc} processes encode "
              f"{many['enc_mbs'] / one['enc_mbs']:.2f}x as fast as 1 ({many['enc_mbs']:.2f} vs "
              f"{one['enc_mbs']:.2f} MB/s); the whole run {one['wall'] / many['wall']:.2f}x")


if __name__ == "__main__":
    main()
