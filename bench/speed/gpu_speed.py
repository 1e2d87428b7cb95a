"""
How fast the size users train runs on one GPU, as one table (bench/cuda_check.sh runs it last):
config/gpt2_124m.py's model (vocabulary 32,768, the recipe's) trained as train.py trains it,
compiled, bf16 autocast, fused AdamW (or --optimizer=muon), flash attention: tokens/s, MFU
against the GPU's bf16 datasheet peak (harness/mfu.py) and peak memory; then decoding
with the compiled CUDA-graph step at batch 1 and 8 (tokens/s), beside transformers' `generate`
on the same weights as the exported GPT-NeoX model. Random weights and tokens: speed does not
depend on what was learned.

    python bench/speed/gpu_speed.py                          # a few minutes on an H100-class GPU
    python bench/speed/gpu_speed.py --optimizer=muon --steps=50
    python bench/speed/gpu_speed.py --device=cpu --tiny      # the same code on a CPU (the tests)

Tokens/s is tokens over the wall time of the timed steps, after --warmup untimed ones (the
compilation); MFU is harness/mfu.flops_per_token x tokens/s / peak, the formula train.py's
progress line uses (tests/test_bench.py checks it against torch's FLOP counter). Decoding
times whole generate calls after a warm-up call, the 16-token prompt's prefill included, in
both columns. --peak sets the peak (FLOP/s) where the table has none (a CPU).
"""
import argparse
import contextlib
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import optim  # noqa: E402
from decode import generate  # noqa: E402
from harness.build import build_model  # noqa: E402
from harness.flags import run_config_file  # noqa: E402
from harness.device import native_bf16  # noqa: E402
from harness.mfu import flops_per_token, peak_flops  # noqa: E402
from model import RoFormerConfig  # noqa: E402

TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=2, vocab_size=256)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="config/gpt2_124m.py")
    ap.add_argument("--vocab_size", type=int, default=32768, help="the recipe's tokenizer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"))
    ap.add_argument("--steps", type=int, default=30, help="timed training steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    ap.add_argument("--new_tokens", type=int, default=256, help="decoded per generate call")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (the tests)")
    ap.add_argument("--peak", type=float, default=0.0, help="FLOP/s for MFU (0: datasheet)")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: no CUDA device here (--device=cpu --tiny runs the same code on a CPU)")
    return args


def model_shape(args):
    """(RoFormerConfig, batch size): the config file's model and batch, or TINY."""
    if args.tiny:
        shape = dict(TINY)
    else:
        scope = run_config_file(os.path.join(ROOT, args.config))
        keys = ("n_layer", "n_head", "n_embd", "block_size", "batch_size")
        shape = dict({k: scope[k] for k in keys if k in scope}, vocab_size=args.vocab_size)
    batch = shape.pop("batch_size", 12)
    return RoFormerConfig(**shape), batch


def synced(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def attention_kernel(device):
    """Flash attention on a GPU (what a bf16 run should get; an error if it cannot), torch's
    choice elsewhere."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def train_speed(cfg, batch, args):
    """The figures of --steps timed training steps (after --warmup), as train.py runs one."""
    dev = torch.device(args.device)
    bf16 = native_bf16(dev.type)
    raw, model, _ = build_model(cfg, 1337, dev, compile=args.compile)
    opt = optim.build_optimizer(raw, 6e-4, 0.1, (0.9, 0.95), dev.type, name=args.optimizer,
                                bf16=bf16)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)
    gen = torch.Generator(device=dev).manual_seed(0)
    x, y = torch.randint(0, cfg.vocab_size, (2, batch, cfg.block_size), device=dev,
                         generator=gen)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with attention_kernel(dev):
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                t0 = synced(dev)
            with autocast:
                loss = model(x, y)[1]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        seconds = synced(dev) - t0
    tokens = args.steps * batch * cfg.block_size
    peak = args.peak or peak_flops(dev.type, "bfloat16" if bf16 else "float32")
    per_token = flops_per_token(cfg, raw.num_params(), cfg.block_size)
    return {"params": raw.num_params(), "batch": batch, "block": cfg.block_size,
            "steps": args.steps, "step_ms": 1e3 * seconds / args.steps,
            "dtype": "bfloat16" if bf16 else "float32", "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "flops_per_token": per_token, "peak": peak,
            "mfu": per_token * tokens / seconds / peak if peak else None,
            "peak_memory": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            "loss": loss.item(), "model": raw}


def timed_generate(fn, device):
    """(seconds of one call after a warm-up call, its output)."""
    fn()  # warm-up: compilation, CUDA graph capture, allocator
    t0 = synced(device)
    out = fn()
    return synced(device) - t0, out


def hf_model(model, dtype):
    """transformers' GPTNeoXForCausalLM holding `model`'s weights, as export.py maps them."""
    import transformers
    from formats.hf import neox_config, neox_weights
    name = str(dtype).removeprefix("torch.")
    hf = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **neox_config(model.config, None, name)))
    weights = neox_weights(model, dtype)
    if "lm_head.weight" in hf.state_dict():  # transformers 5's name for the file's embed_out
        weights["lm_head.weight"] = weights.pop("embed_out.weight")
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k and "inv_freq" not in k]:
        raise RuntimeError(f"GPT-NeoX weights do not fit: {unexpected} {missing}")
    return hf.to(dtype=dtype, device=next(model.parameters()).device).eval()


def decode_speed(model, args):
    """Per batch size: our compiled (CUDA-graph on a GPU) decode's tokens/s and, beside it,
    transformers' generate on the same weights (None without transformers or --no-hf)."""
    dev = next(model.parameters()).device
    dtype = torch.bfloat16 if native_bf16(dev.type) else torch.float32
    model = model.to(dtype).eval()
    hf = None
    if args.hf:
        try:
            hf = hf_model(model, dtype)
        except ImportError:
            print("note: transformers is not installed: no generate column", file=sys.stderr)
    rows = []
    for b in map(int, args.batches.split(",")):
        prompt = torch.randint(0, model.config.vocab_size, (b, 16), device=dev)
        n = args.new_tokens
        ours, tokens = timed_generate(lambda: generate(model, prompt, n, temperature=0,
                                                       compile=args.compile), dev)
        row = {"batch": b, "new_tokens": n, "seconds": ours, "tokens_per_s": b * n / ours,
               "hf_seconds": None, "hf_tokens_per_s": None, "hf_same_tokens": None}
        if hf is not None:
            theirs, hf_tokens = timed_generate(lambda: hf.generate(
                prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                attention_mask=torch.ones_like(prompt)), dev)
            # greedy on the same weights: the share of new tokens both drew (bf16 rounding
            # may part them late in a long decode)
            same = (tokens[:, 16:] == hf_tokens[:, 16:]).float().mean().item()
            row.update(hf_seconds=theirs, hf_tokens_per_s=b * n / theirs, hf_same_tokens=same)
        rows.append(row)
    return rows


def table(train, decode, device_name):
    """The markdown table of both measurements."""
    gib = train["peak_memory"] and train["peak_memory"] / 2 ** 30
    lines = [f"{device_name}: {train['params'] / 1e6:.1f}M parameters, batch {train['batch']} x "
             f"{train['block']}, {train['dtype']}", "", "| measure | value |", "|---|---:|",
             f"| train tokens/s | {train['tokens_per_s']:,.0f} |",
             f"| train step | {train['step_ms']:.1f} ms |",
             "| MFU | " + (f"{100 * train['mfu']:.1f}% of {train['peak'] / 1e12:.0f} TFLOP/s |"
                          if train["mfu"] is not None else "n/a (no peak) |"),
             "| peak memory | " + (f"{gib:.2f} GiB |" if gib else "n/a |")]
    for r in decode:
        theirs = r["hf_tokens_per_s"]
        hf = (f"{theirs:,.1f} (ours {r['tokens_per_s'] / theirs:.2f}x; "
              f"{100 * r['hf_same_tokens']:.0f}% same tokens)" if theirs else "-")
        lines.append(f"| decode batch {r['batch']} tokens/s: ours, transformers | "
                     f"{r['tokens_per_s']:,.1f}, {hf} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg, batch = model_shape(args)
    torch.backends.cuda.matmul.allow_tf32 = True
    train = train_speed(cfg, batch, args)
    decode = decode_speed(train.pop("model"), args)
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(table(train, decode, name))
    if args.json:
        print(json.dumps({"train": train, "decode": decode}))


if __name__ == "__main__":
    main()
