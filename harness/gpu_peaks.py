"""The datasheet peaks of GPUs, for MFU (harness/mfu.py imports this only on a CUDA device)."""


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
