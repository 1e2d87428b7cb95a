"""MFU: model FLOPs per second of one device over that device's peak, the peak being a GPU's
datasheet figure (harness/gpu_peaks.py). A CPU has none: n/a there (peak_flops says why)."""
import torch

CPU_NO_PEAK = ("n/a on a CPU: it has no datasheet peak, and one timed here measures how busy "
               "the machine is as much as the CPU (slower runs showed higher MFUs); compare "
               "tokens/s")


def peak_flops(device_type, dtype):
    """FLOP/s of ONE device (this process's) for MFU: a GPU's datasheet peak in the dtype that
    runs, else None. Not a CPU's: a rate timed at the start of a run moved with the load on
    the machine, and one from the CPU's flags (cores x clock x FLOPs per cycle) would have to
    guess the clock under load and the number of vector units, which no flag tells."""
    if device_type == "cuda":  # the datasheet table: only a GPU run needs it
        from harness.gpu_peaks import gpu_peak_flops
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
