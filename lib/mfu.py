"""MFU: model FLOPs per second of one device over that device's peak, the peak being a GPU's
datasheet figure or this CPU's matmul rate, timed at the start of the run."""
import time

import torch


# Dense (no sparsity) peaks of one card from the vendors' datasheets, FLOP/s by the dtype that
# runs: bf16/fp16 tensor cores, and for float32 the TF32 tensor-core rate where the card has one
# (train.py allows TF32 matmuls), else plain fp32. The variants of one family differ a lot (H100
# SXM vs PCIe, A10 vs A10G, L40 vs L40S), so names are matched by whole words; an unknown card
# or a dtype the card only emulates (bf16 on a V100 or T4) gets no MFU rather than a wrong one.
GPU_PEAK_FLOPS = {  # (bfloat16, float16, float32)
    ("h200",): (989e12, 989e12, 494.5e12), ("h200", "nvl"): (835e12, 835e12, 417.5e12),
    ("h100",): (989e12, 989e12, 494.5e12), ("h100", "pcie"): (756e12, 756e12, 378e12),
    ("h100", "nvl"): (835e12, 835e12, 417.5e12),
    ("a100",): (312e12, 312e12, 156e12), ("a30",): (165e12, 165e12, 82e12),
    ("a10",): (125e12, 125e12, 62.5e12), ("l4",): (121e12, 121e12, 60e12),
    ("l40",): (181e12, 181e12, 90.5e12), ("l40s",): (362e12, 362e12, 183e12),
    ("v100",): (None, 125e12, 15.7e12), ("v100", "pcie"): (None, 112e12, 14e12),
    ("t4",): (None, 65e12, 8.1e12),
}


def gpu_peak_flops(name, dtype="float16"):
    """Peak FLOP/s of one card from its torch.cuda.get_device_name() for a run in `dtype`, or
    None if unknown. "NVIDIA H100 80GB HBM3" is the SXM part; PCIe and NVL parts say so."""
    words = set(name.lower().replace("-", " ").split())
    keys = [key for key in GPU_PEAK_FLOPS if set(key) <= words]
    if not keys:
        return None
    best = max(keys, key=len)  # the most specific match wins
    return GPU_PEAK_FLOPS[best][("bfloat16", "float16", "float32").index(dtype)]


def peak_flops(device_type, dtype, ddp):
    """FLOP/s of ONE device (this process's) for MFU: a GPU's datasheet peak in the dtype that
    runs, the CPU's timed matmul rate (a CPU has no honest datasheet number), else None."""
    if device_type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(), dtype)
    return cpu_peak_flops(getattr(torch, dtype), ddp) if device_type == "cpu" else None


def time_matmul(dtype, seconds=0.2, bursts=4):
    """FLOP/s of a 1024^3 matmul in `dtype` on this process's threads: the best of a few short
    bursts, so that a moment of load from other processes does not lower it."""
    a = torch.randn(1024, 1024, dtype=dtype)
    a @ a  # warm up
    best = 0.0
    for _ in range(bursts):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / bursts:
            a @ a
            calls += 1
        best = max(best, 2 * 1024 ** 3 * calls / (time.perf_counter() - t0))
    return best


def cpu_peak_flops(dtype, ddp):
    """One process's CPU peak in `dtype`: time_matmul's rate, timed afresh by every run (no file
    kept in the user's home to go stale; the probe takes a fraction of a second). Under DDP
    rank 0 times it alone and shares it: ranks timing at once on shared cores would each
    measure a fraction of it."""
    peak = torch.zeros((), dtype=torch.float64)
    if not ddp or torch.distributed.get_rank() == 0:
        peak.fill_(time_matmul(dtype))
    if ddp:
        torch.distributed.broadcast(peak, src=0)
    return peak.item()


def flops_per_token(cfg, n_params, seq_len):
    """Training FLOPs per token at length seq_len: 6 per parameter, plus attention."""
    if cfg.attention == "softmax":  # q.k and att.v over seq_len keys, no causal discount
        attn = 2 * 2 * seq_len * cfg.n_embd
    else:  # two causal chunk (L x L) products, plus the state's read and update
        length, d = min(cfg.linear_chunk, seq_len), cfg.n_embd // cfg.n_head
        attn = 2 * cfg.n_embd * (2 * length + 2 * d)
    return 6 * n_params + 3 * cfg.n_layer * attn
