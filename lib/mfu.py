"""MFU: model FLOPs per second of one device over that device's peak, the peak being a GPU's
datasheet figure (lib/gpu_peaks.py) or this CPU's matmul rate, timed at the start of the run."""
import time

import torch


def peak_flops(device_type, dtype, ddp):
    """FLOP/s of ONE device (this process's) for MFU: a GPU's datasheet peak in the dtype that
    runs, the CPU's timed matmul rate (a CPU has no honest datasheet number), else None."""
    if device_type == "cuda":  # the datasheet table: only a GPU run needs it
        from lib.gpu_peaks import gpu_peak_flops
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
