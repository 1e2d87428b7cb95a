"""
What every script shares: the one user-error type and the one place it becomes a line, the
repo root, atomic writes, the config parser, and the device/dtype resolver. Imports nothing of
the project, and torch only inside the functions that need it (data/'s workers import this).
"""
import ast
import difflib
import functools
import hashlib
import math
import os
import shutil
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class UserError(Exception):
    """A mistake the user can fix (a flag, a path, a file): one line `error: ...`, exit 1."""


created_dirs = []  # folders this command made: a failure removes them again while empty
created_files = []  # files that mean nothing once it fails (train.py's out_dir lock)


def error_line(msg):
    """The one form a user error takes: the line `error: msg`."""
    return f"error: {msg}"


def cleanup():
    """What a failed command undoes before it says why: no empty folder it made is left behind
    (empty but for its created_files)."""
    for d in created_dirs:
        if os.path.isdir(d) and all(os.path.join(d, f) in created_files for f in os.listdir(d)):
            shutil.rmtree(d, ignore_errors=True)


def excepthook(kind, value, tb):
    """sys.excepthook of a script without a main (train.py): a UserError is its line, exit 1
    (under torchrun once, by the first rank that hits it: lib/torchrun_errors.py)."""
    if issubclass(kind, UserError):
        cleanup()
        line = error_line(value)
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # under torchrun only
            from lib.torchrun_errors import said_by_another_rank
            if said_by_another_rank(line):
                return
        print(line, file=sys.stderr, flush=True)
    else:
        sys.__excepthook__(kind, value, tb)


def cli(main, interrupted=130):
    """A script's main(argv), a UserError ending as its line and Ctrl-C as exit `interrupted`
    (a code, or a message)."""
    @functools.wraps(main)
    def run(argv=None):
        try:
            return main(sys.argv[1:] if argv is None else argv)
        except UserError as e:
            cleanup()
            sys.exit(error_line(e))
        except KeyboardInterrupt:
            sys.exit(interrupted)
    return run


# ----------------------------------------------------------------------------------------
# files: atomic writes (temp, fsync, rename, fsync the folder), the out_dir check, hashes

def fsync(path):
    """Flush a file, or a folder's entries (a rename survives a power loss only once its folder
    is on disk too), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def publish(tmp, path):
    """Rename the finished temp file or folder `tmp` to `path`, synced before and after. A
    folder replaces the previous one only once the new one is complete."""
    for name in os.listdir(tmp) if os.path.isdir(tmp) else ():
        fsync(os.path.join(tmp, name))
    fsync(tmp)
    if os.path.isdir(tmp) and os.path.isdir(path):
        os.rename(path, tmp + ".old")
        os.rename(tmp, path)
        remove(tmp + ".old")
    else:
        os.replace(tmp, path)
    fsync(os.path.dirname(os.path.abspath(path)))


def atomic_write(path, write, check=None, tmp=None):
    """write(tmp) fills a temp file or folder next to `path`; it is synced, checked (check(tmp)
    returns a reason it is wrong, or None) and only then renamed to `path`. Whatever fails, no
    temp is left and `path` stays as it was. Returns the check's reason or None; OSErrors are
    the caller's to word."""
    tmp = tmp or os.path.join(os.path.dirname(os.path.abspath(path)),
                              f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        for leftover in (tmp, tmp + ".old"):  # of a killed write that had this pid
            remove(leftover)
        write(tmp)
        problem = check(tmp) if check else None
        if problem is None:
            publish(tmp, path)
        return problem
    except OSError:
        if os.path.isdir(tmp + ".old") and not os.path.exists(path):
            os.rename(tmp + ".old", path)
        raise
    finally:
        remove(tmp)


def check_seed(seed):
    """The one seed rule (train, sample, prepare): numpy takes no negative seed, and
    torch.Generator.manual_seed and data/'s seed keys (shared.mix64) are 64-bit unsigned."""
    if not 0 <= seed < 2 ** 64:
        raise UserError(f"seed must be from 0 to 2**64 - 1, got {seed}")


def make_out_dir(path, what="out_dir"):
    """Create `path` if needed and prove now, before any long work, that files can be written
    there. Returns True when this call created it (a failure removes it again while empty)."""
    if not path:  # '' is no folder; os.makedirs would say "No such file or directory: ''"
        raise UserError(f"{what} is empty: pass a folder")
    created = not os.path.isdir(path)
    try:
        os.makedirs(path, exist_ok=True)
        if created:
            created_dirs.append(path)
        probe = os.path.join(path, f".write-probe.{os.getpid()}")
        open(probe, "wb").close()
        os.remove(probe)
    except OSError as e:
        if created and os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)
        raise UserError(f"cannot write to {what} {path}: {e.strerror or e}") from None
    return created


def file_sha256(path):
    """A tokenizer's identity: train.py records it, sample.py checks it, so a retrained
    tokenizer never silently turns ids into the wrong text."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------
# configuration, nanoGPT style: a script's module-level defaults, then config files (plain
# Python that assigns variables), then --key=value. A mistake is one line that names the key.

SCALARS = (bool, int, float, str, type(None))


def unknown_key(key, known):
    near = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return UserError(f"unknown config key '{key}'{hint}")


def coerce(key, value, default):
    """`value` checked against the type of the default; ints are accepted where floats are."""
    if not isinstance(value, SCALARS):  # a tuple or list would otherwise pass unnoticed
        raise UserError(f"config key '{key}' takes a single {type(default).__name__} value, "
                        f"got {value!r} ({type(value).__name__})")
    if default is None:
        return value
    if type(default) is float and type(value) is int:
        try:
            value = float(value)
        except OverflowError:  # an int past float's range (10**400): refused below
            value = math.inf
    if type(value) is not type(default):
        raise UserError(f"config key '{key}' must be {type(default).__name__} (default "
                        f"{default!r}), got {value!r} ({type(value).__name__})")
    if type(value) is float and not math.isfinite(value):  # 1e999 reads as inf; no key takes it
        raise UserError(f"config key '{key}' must be a finite number, got {value!r}")
    return value


def parse_value(key, text, default):
    """The text after '=': for a string key exactly as typed (quotes kept, --start=42 is text);
    otherwise a Python literal (or true/false for a boolean)."""
    if isinstance(default, str):
        return text
    if isinstance(default, bool) and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if default is None:
            return text
        raise UserError(f"config key '{key}': cannot read {text!r} as a "
                        f"{type(default).__name__}") from None


def run_config_file(path):
    """The names the config file `path` assigns; an error in it names the file and line."""
    scope = {}
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), scope)
    except SyntaxError as e:
        raise UserError(f"{path}, line {e.lineno}: syntax error: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config file {path}: {e}") from None
    except Exception as e:  # raised while the file ran: the deepest line of that file
        lines = [fr.lineno for fr in traceback.extract_tb(e.__traceback__) if fr.filename == path]
        where = f", line {lines[-1]}" if lines else ""
        raise UserError(f"{path}{where}: {type(e).__name__}: {e}") from None
    return scope


def configure(defaults, argv, given=None):
    """`defaults` (name -> scalar) updated by the config files and --key=value in `argv`. The
    keys they set are added to the set `given` if one is passed: a key set to its default value
    is given all the same (train.py's init_from=RUN keeps RUN's value of a key not given)."""
    config, known = dict(defaults), sorted(defaults)
    given = set() if given is None else given
    for arg in argv:
        if not arg.startswith("--"):  # a config file
            if not os.path.isfile(arg):
                raise UserError(f"config file not found: {arg}")
            for key, value in run_config_file(arg).items():
                if key.startswith("_") or (key not in defaults and not isinstance(value, SCALARS)):
                    continue  # __builtins__, imported modules, helper functions
                try:
                    if key not in defaults:
                        raise unknown_key(key, known)
                    config[key] = coerce(key, value, defaults[key])
                    given.add(key)
                except UserError as e:
                    raise UserError(f"{arg}: {e}") from None
            continue
        key, eq, text = arg[2:].partition("=")
        if key not in defaults:
            raise unknown_key(key, known)
        if not eq:  # a bare --flag sets a boolean
            if not isinstance(defaults[key], bool):
                raise UserError(f"config key '{key}' needs a value: --{key}=...")
            text = "true"
        config[key] = coerce(key, parse_value(key, text, defaults[key]), defaults[key])
        given.add(key)
    return config


# ----------------------------------------------------------------------------------------
# the device and dtype every script runs in

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
