"""
Configuration shared by train.py, sample.py and the bench scripts, in the style nanoGPT users
know: a script's module-level defaults, then config files (plain Python that assigns
variables), then --key=value overrides, applied in that order.

    python train.py config/small.py --batch_size=32 --compile=False

Every mistake stops with one line that names the key: an unknown key (with the nearest valid
one), a value of the wrong type, a missing config file. Also here: file_sha256, the
tokenizer identity that train.py records and sample.py checks, and the facts about the
hardware that the scripts' `auto` choices and MFU rest on.
"""
import ast
import difflib
import hashlib
import os
import traceback

SCALARS = (bool, int, float, str, type(None))


class ConfigError(ValueError):
    pass


def _unknown(key, known):
    near = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _coerce(key, value, default):
    """Check `value` against the type of the default; ints are accepted where floats are."""
    if not isinstance(value, SCALARS):  # a tuple or list would otherwise pass unnoticed
        raise ConfigError(f"config key '{key}' takes a single {type(default).__name__} value, "
                          f"got {value!r} ({type(value).__name__})")
    if default is None:
        return value
    want = type(default)
    if want is float and type(value) is int:
        return float(value)
    if type(value) is not want:
        raise ConfigError(f"config key '{key}' must be {want.__name__} (default {default!r}), "
                          f"got {value!r} ({type(value).__name__})")
    return value


def _parse(key, text, default):
    """The text after '='. For a string key it is the value itself, exactly as typed:
    a quoted docstring keeps its quotes, --start=42 and --start=None are text. Otherwise it
    is read as a Python literal (true/false are accepted for booleans)."""
    if isinstance(default, str):
        return text
    if isinstance(default, bool) and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if default is None:
            return text
        raise ConfigError(f"config key '{key}': cannot read {text!r} as a "
                          f"{type(default).__name__}") from None


def run_config_file(path):
    """Execute the config file `path`; return the names it assigned. A syntax error, or an
    exception the file raises, is a ConfigError naming the file and the line."""
    scope = {}
    try:
        with open(path, encoding="utf-8") as f:
            code = compile(f.read(), path, "exec")
        exec(code, scope)
    except SyntaxError as e:
        raise ConfigError(f"{path}, line {e.lineno}: syntax error: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except Exception as e:  # raised while the file ran: the deepest line of that file
        lines = [fr.lineno for fr in traceback.extract_tb(e.__traceback__) if fr.filename == path]
        where = f", line {lines[-1]}" if lines else ""
        raise ConfigError(f"{path}{where}: {type(e).__name__}: {e}") from None
    return scope


def configure(defaults, argv):
    """Return a copy of `defaults` (name -> scalar) updated by the config files and
    --key=value arguments in `argv`. Raises ConfigError with a one-line message."""
    config = dict(defaults)
    known = sorted(defaults)
    for arg in argv:
        if not arg.startswith("--"):  # a config file
            if not os.path.isfile(arg):
                raise ConfigError(f"config file not found: {arg}")
            scope = run_config_file(arg)
            for key, value in scope.items():
                if key.startswith("_") or (key not in defaults and not isinstance(value, SCALARS)):
                    continue  # __builtins__, imported modules, helper functions
                if key not in defaults:
                    raise ConfigError(f"{arg}: {_unknown(key, known)}")
                try:
                    config[key] = _coerce(key, value, defaults[key])
                except ConfigError as e:
                    raise ConfigError(f"{arg}: {e}") from None
            continue
        key, eq, text = arg[2:].partition("=")
        if key not in defaults:
            raise _unknown(key, known)
        if not eq:  # a bare --flag sets a boolean
            if not isinstance(defaults[key], bool):
                raise ConfigError(f"config key '{key}' needs a value: --{key}=...")
            config[key] = True
            continue
        config[key] = _coerce(key, _parse(key, text, defaults[key]), defaults[key])
    return config


def file_sha256(path):
    """The identity of a tokenizer file: train.py records it in the checkpoint, sample.py
    checks it, so a retrained tokenizer never silently turns ids into the wrong text."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------
# hardware facts behind dtype=auto and MFU

def cpu_has_bf16():
    """True where the CPU multiplies bf16 natively (AVX512-BF16 or AMX): there bf16 autocast is
    several times faster than fp32; elsewhere it is emulated and slower."""
    import torch
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:  # not Linux: be conservative
        return False
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and torch.backends.mkldnn.is_available()


def cuda_autocast_dtype():
    """"bfloat16" where the GPU computes bf16 natively (Ampere and later), else "float16" (with
    a GradScaler when training). torch counts emulated bf16 as supported unless asked not to,
    and on a T4 or V100 emulation is several times slower than fp16."""
    import torch
    try:
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # an older torch without the argument counted native support only
        native = torch.cuda.is_bf16_supported()
    return "bfloat16" if native else "float16"


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
PEAK_DTYPES = ("bfloat16", "float16", "float32")


def gpu_peak_flops(name, dtype="float16"):
    """Peak FLOP/s of one card from its torch.cuda.get_device_name() for a run in `dtype`, or
    None if unknown. "NVIDIA H100 80GB HBM3" is the SXM part; PCIe and NVL parts say so in
    their names."""
    words = set(name.lower().replace("-", " ").split())
    best = None
    for key, flops in GPU_PEAK_FLOPS.items():
        if key[0] in words and all(w in words for w in key[1:]):
            if best is None or len(key) > len(best[0]):  # the most specific match wins
                best = (key, flops)
    return best[1][PEAK_DTYPES.index(dtype)] if best else None
