"""The device and dtype every script runs in: 'auto' resolved, the names checked before anything
loads, whether the CPU or GPU multiplies bf16 natively, and whether torch.compile finds a C++
compiler here (cxx_compiler_found). Imports of the project only harness/common.py
(UserError), and torch only inside the functions that need it."""
import functools
import os
import shutil
import sys

from harness.common import UserError


@functools.lru_cache(maxsize=None)
def cpu_has_bf16():
    """True where the CPU multiplies bf16 natively (AVX512-BF16 or AMX) and torch uses it:
    there bf16 is faster than fp32, elsewhere emulated, ~100x slower. The flags are not enough
    (a torch build, or ONEDNN_MAX_CPU_ISA, may not use them), so products of each kind are
    timed: native bf16 beats float32, emulated is two orders of magnitude behind it, a margin
    that load on the machine does not close (one thread, kinds interleaved, best of each)."""
    import torch
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:  # not Linux: be conservative
        return False
    if not (("avx512_bf16" in flags or "amx_bf16" in flags)
            and torch.backends.mkldnn.is_available()):
        return False
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no wait on a second thread that another process holds up
    try:
        best = {dtype: float("inf") for dtype in (torch.bfloat16, torch.float32)}
        for _ in range(6):
            for dtype in best:
                best[dtype] = min(best[dtype], matmul_seconds(dtype))
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] < 2 * best[torch.float32]


def matmul_seconds(dtype, n=256):
    """The time of one n^3 product in `dtype` (after one that sets the kernel up)."""
    import time
    import torch
    a = torch.ones(n, n, dtype=dtype)
    a @ a
    t0 = time.perf_counter()
    a @ a
    return time.perf_counter() - t0


def native_bf16(device_type):
    """Whether the device multiplies bf16 natively: nothing may compute in bf16 elsewhere
    (emulated, a product is ~100x slower than in float32)."""
    if device_type == "cuda":
        return cuda_autocast_dtype() == "bfloat16"
    return device_type == "cpu" and cpu_has_bf16()  # MPS: not assumed


def cuda_autocast_dtype():
    """"bfloat16" where the GPU computes bf16 natively (Ampere and later), else "float16". torch
    counts emulated bf16 as supported unless asked not to; on a T4 or V100 it is several times
    slower than fp16."""
    import torch
    try:
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # an older torch without the argument counted native support only
        native = torch.cuda.is_bf16_supported()
    return "bfloat16" if native else "float16"


def busy_cores(readings=10, interval=0.01):
    """How many cores other processes keep busy now: the runnable tasks the kernel counts
    (/proc/loadavg's 4th field) less this one, the least of a few readings, since a task that
    ran for a moment is no load while one that computes is runnable at every reading. Not the
    load average: it lags by a minute and still holds the run before this one. None where
    there is no /proc/loadavg (not Linux)."""
    import time
    counts = []
    for _ in range(readings):
        try:
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)  # less this reader
        except (OSError, ValueError, IndexError):
            return None
        time.sleep(interval)
    return max(0, min(counts))


def fewer_threads(default, cores, busy):
    """Torch threads for a CPU run on `cores` cores of which other processes keep `busy` busy:
    torch's `default` (one per core), less the busy cores, at least 1. A thread that has to
    wait for a core holds up every parallel op of every step, so a thread too many costs far
    more than a thread too few (docs/SPEED.md#threads-on-a-busy-machine)."""
    return max(1, min(default, cores - busy))


def usable_cores():
    """The cores this process may run on (its affinity where the OS says, else all of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def pick_threads(device_type):
    """(torch threads this run computes with, a note saying why fewer than torch's default, or
    None). Only a CPU run of one process on the machine whose user did not choose: an
    OMP_NUM_THREADS that is set (torchrun sets it for its workers) is kept as it is."""
    import torch
    n = torch.get_num_threads()
    if (device_type != "cpu" or "OMP_NUM_THREADS" in os.environ
            or int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > 1):
        return n, None
    busy, cores = busy_cores(), usable_cores()
    if busy is None or not cores:
        return n, None
    want = fewer_threads(n, cores, busy)
    if want == n:
        return n, None
    torch.set_num_threads(want)
    return want, (f"note: {want} torch thread{'s' * (want > 1)}, not {n}: {busy} other "
                  f"task(s) are running on this machine's {cores} cores, and a thread that "
                  f"waits for a core stalls every step (docs/SPEED.md); OMP_NUM_THREADS={n} "
                  f"overrides")


def device_memory(dev):
    """Bytes of memory on the device: a GPU's total, else the machine's RAM; None where the
    platform does not say (no sysconf: Windows)."""
    import torch
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def placed(dev, local_rank=0):
    """The device this process trains on: `dev` where it names a GPU (cuda:1) or is no GPU,
    else cuda:LOCAL_RANK (torchrun's one GPU per process; cuda:0 for one process), since
    torch.cuda.set_device refuses a bare cuda. pick_device leaves the index to this, so that
    every rank picks its own."""
    import torch
    return torch.device("cuda", local_rank) if dev.type == "cuda" and dev.index is None else dev


def pick_device(device="auto", dtype="auto", training=False):
    """Resolve 'auto' and check the names before anything loads; returns (torch.device, dtype
    name). Training also takes MPS, and bf16 autocast on a CPU that multiplies bf16 natively
    (faster, same loss at equal steps; docs/SPEED.md); decoding stays float32 on the CPU."""
    import torch
    mps = getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if training and mps else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UserError(f"unknown device {device!r} (auto, cpu, cuda, cuda:N, mps)") from None
    n = torch.cuda.device_count() if dev.type == "cuda" and torch.cuda.is_available() else 0
    if dev.type not in ("cpu", "cuda", "mps"):  # meta holds no data; others are untested here
        raise UserError(f"device={device!r} is not supported (auto, cpu, cuda, cuda:N, mps)")
    if dev.type == "cuda" and not n:
        raise UserError(f"device={device!r} but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= n:
        raise UserError(f"device={device!r} but this machine has {n} CUDA device(s) (cuda:0 to "
                        f"cuda:{n - 1})")
    if dev.type == "mps" and not mps:
        raise UserError(f"device={device!r} but MPS (Apple's GPU backend) is not available")
    if dtype == "auto":  # CUDA: bf16 where native, else fp16
        dtype = (cuda_autocast_dtype() if dev.type == "cuda"
                 else "bfloat16" if training and dev.type == "cpu" and cpu_has_bf16()
                 else "float32")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    if training and dtype == "float16" and dev.type != "cuda":
        raise UserError("dtype=float16 needs CUDA (its GradScaler); use bfloat16 or float32")
    if training and dtype == "bfloat16" and dev.type == "cpu" and not cpu_has_bf16():
        print("warning: this CPU has no native bf16 matmul; bfloat16 will be emulated and slow")
    return dev, dtype


def cxx_compiler_found():
    """Whether torch.compile can build CPU kernels here: inductor compiles them with a C++
    compiler ($CXX, else g++ on Linux and clang++ on macOS) and fails at the first forward,
    with a traceback, where there is none. Asked of inductor itself where this torch has it."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError:  # another torch: look where this one's inductor looks
        default = "clang++" if sys.platform == "darwin" else "g++"
        return shutil.which(os.environ.get("CXX", default)) is not None
    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        return False
    return True
