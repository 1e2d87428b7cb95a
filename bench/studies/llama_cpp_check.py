"""
A trained run through export.py --gguf and llama.cpp (llama-cpp-python): for each of f32, f16
and q8_0, the file size, the largest logit difference to our model, whether greedy text and
token ids match, and bits per byte on the first --tokens tokens of the run's val.bin, scored by
llama.cpp with eval.py's windows, next to eval.py's own score of the same tokens.

    python train.py config/small.py                       # or any softmax + RoPE run
    python bench/studies/llama_cpp_check.py --out_dir=out-small --tokens 50000

llama-cpp-python must be installed (`pip install llama-cpp-python` compiles llama.cpp). A build
with Intel AMX kernels (the default on a CPU that has AMX) crashed in its q8_0 matrix product
on this project's machines; `CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON
-DGGML_FMA=ON -DGGML_F16C=ON"` builds one without them.
"""
import argparse
import math
import os
import sys
import tempfile

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from harness.common import cli  # noqa: E402
from harness.load import load_run  # noqa: E402
import eval as evalpy  # noqa: E402
import export  # noqa: E402
from formats import gguf as gguf_export  # noqa: E402


def llama_cpp_nats(llm, ids, window, stride):
    """Total -log p over targets 1..n-1 of ids, from llama.cpp's logits, with eval.py's windows
    (each target scored once, in the window that eval.py scores it in)."""
    nats = 0.0
    for start, end, first in evalpy.windows(len(ids), window, stride):
        llm.reset()
        llm.eval(ids[start:end])
        logits = np.array(llm.scores[:end - start], dtype=np.float64)
        for t in range(first, end + 1):
            row = logits[t - 1 - start]
            top = row.max()
            nats += top + math.log(np.exp(row - top).sum()) - row[ids[t]]
    return nats


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", default="out-small")
    p.add_argument("--tokens", type=int, default=50_000, help="val.bin tokens to score")
    p.add_argument("--types", default="f32,f16,q8_0")
    args = p.parse_args()
    import llama_cpp  # noqa: F401  (fail early, before exporting)

    torch.set_num_threads(1)
    model, sp, ckpt = load_run(args.out_dir, torch.device("cpu"), "float32")
    val, _ = evalpy.own_split(ckpt, "val")
    ids = [sp.eos_id()] + val[:args.tokens].tolist()  # a split starts after a document's end
    nbytes = len(sp.decode(ids[1:]).encode("utf-8"))
    window = model.config.context_window
    stride = window // 2
    ours, count = evalpy.score(model, [np.array(ids, dtype=np.int64)], stride, 8)
    ours_bpb = ours / math.log(2) / nbytes
    text = sp.decode(ids[1:2000])
    print(f"{args.out_dir}: {model.num_params() / 1e6:.2f}M params, {count:,} tokens, "
          f"{nbytes:,} bytes; eval.py: {ours_bpb:.5f} bits/byte")
    print("| type | size (bytes) | vs f32 | bits/byte, llama.cpp | vs eval.py | max abs logit "
          "difference | token ids | greedy 24 |\n|---|---:|---:|---:|---:|---:|---|---|")
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.types.split(","):
            path = os.path.join(tmp, f"m-{kind}.gguf")
            export.main([f"--out_dir={args.out_dir}", f"--gguf={path}", f"--gguf_type={kind}",
                         "--check=False"])
            sizes[kind] = os.path.getsize(path)
            r = gguf_export.compare_with_llama_cpp(path, model, sp, text)
            llm = llama_cpp.Llama(model_path=path, n_ctx=window, logits_all=True, verbose=False)
            bpb = llama_cpp_nats(llm, ids, window, stride) / math.log(2) / nbytes
            print(f"| {kind} | {sizes[kind]:,} | {sizes[kind] / sizes.get('f32', sizes[kind]):.3f}x"
                  f" | {bpb:.5f} | {100 * (bpb / ours_bpb - 1):+.3f}% | {r['max_logit_diff']:.1e} | "
                  f"{r['texts'] - r['texts_differing']}/{r['texts']} equal | "
                  f"{'equal' if r['greedy_equal'] else 'DIFFER'} |", flush=True)


if __name__ == "__main__":
    cli(lambda argv: main())()  # a UserError (no run there, say) is one line
