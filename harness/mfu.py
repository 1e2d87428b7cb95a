"""MFU: model FLOPs per second of one device over that device's peak, the peak being a GPU's
datasheet figure (GPU_PEAK_FLOPS, below). A CPU has none: n/a there (peak_flops says why)."""
import torch

CPU_NO_PEAK = ("n/a on a CPU: it has no datasheet peak, and one timed here measures how busy "
               "the machine is as much as the CPU (slower runs showed higher MFUs); compare "
               "tokens/s")


def peak_flops(device_type, dtype):
    """FLOP/s of ONE device (this process's) for MFU: a GPU's datasheet peak in the dtype that
    runs, else None. Not a CPU's: a rate timed at the start of a run moved with the load on
    the machine, and one from the CPU's flags (cores x clock x FLOPs per cycle) would have to
    guess the clock under load and the number of vector units, which no flag tells."""
    if device_type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(), dtype)
    return None


def flops_per_token(cfg, n_params, seq_len):
    """Training FLOPs per token at length seq_len: 6 per parameter, plus attention."""
    if cfg.attention == "softmax":  # q.k and att.v over seq_len keys, no causal discount
        attn = 2 * 2 * seq_len * cfg.n_embd
    else:  # two causal chunk (L x L) products, plus the state's read and update
        length, d = min(cfg.linear_chunk, seq_len), cfg.n_embd // cfg.n_head
        attn = 2 * cfg.n_embd * (2 * length + 2 * d)
    return 6 * n_params + 3 * cfg.n_layer * attn



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
