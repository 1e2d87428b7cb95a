"""harness/flags.configure: the precedence defaults < config files < --key=value, type checks
against the defaults, and one-line errors that name the key."""
import hashlib
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness.common import UserError as ConfigError  # noqa: E402
from harness.flags import configure  # noqa: E402
from harness.run_tokenizer import file_sha256  # noqa: E402

DEFAULTS = {"batch_size": 16, "learning_rate": 6e-4, "compile": True, "device": "auto",
            "out_dir": "out"}


def test_files_then_arguments_override_in_order(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import math\nbatch_size = 8\nlearning_rate = 1e-3\n_private = object()\n")
    b.write_text("batch_size = 4\ndef helper():\n    pass\n")
    cfg = configure(DEFAULTS, [str(a), str(b), "--learning_rate=2", "--compile=false",
                               "--device=cuda:1"])
    assert cfg == {"batch_size": 4, "learning_rate": 2.0, "compile": False, "device": "cuda:1",
                   "out_dir": "out"}
    assert type(cfg["learning_rate"]) is float  # an int is accepted where a float is due
    assert DEFAULTS["batch_size"] == 16  # the defaults are not mutated
    assert configure(DEFAULTS, ["--compile"])["compile"] is True  # a bare flag sets a bool


def test_flags_override_config_files_wherever_they_stand(tmp_path):
    """Issue 60 item 10: `train.py --n_layer=2 --max_iters=3 one.py` trained one.py's values
    without a word, though the README says config files, then flags. Flags now apply after
    every config file whatever the order (a config file cannot read a flag, so a later file
    could only undo one); files still apply in their own order."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("batch_size = 8\nlearning_rate = 1e-3\n")
    b.write_text("batch_size = 4\n")
    for argv in (["--batch_size=2", str(a), str(b)], [str(a), "--batch_size=2", str(b)],
                 [str(a), str(b), "--batch_size=2"]):
        given = set()
        cfg = configure(DEFAULTS, argv, given)
        assert (cfg["batch_size"], cfg["learning_rate"]) == (2, 1e-3), argv
        assert given == {"batch_size", "learning_rate"}
    assert configure(DEFAULTS, ["--compile=false", str(b), str(a)])["batch_size"] == 8


def test_a_folder_for_a_config_file_says_it_is_a_folder(tmp_path):
    """Issue 60 item 16: `train.py config` (the folder) said "config file not found" of a
    folder that is there. It says it is a folder and names a config file in it."""
    (tmp_path / "small.py").write_text("batch_size = 8\n")
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, [str(tmp_path)])
    msg = str(e.value)
    assert f"{tmp_path} is a folder, not a config file" in msg and "\n" not in msg, msg
    assert str(tmp_path / "small.py") in msg  # the way out, runnable as it is
    assert configure(DEFAULTS, [str(tmp_path / "small.py")])["batch_size"] == 8


@pytest.mark.parametrize("argv,words", [
    (["--batch_sise=3"], ["batch_sise", "did you mean 'batch_size'"]),
    (["--batch_size=3.5"], ["batch_size", "int"]),
    (["--compile=2"], ["compile", "bool"]),
    (["--learning_rate=fast"], ["learning_rate", "float"]),
    (["--batch_size"], ["batch_size", "needs a value"]),
    (["no/such/config.py"], ["config file not found"]),
])
def test_mistakes_are_one_line_errors_naming_the_key(argv, words):
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, argv)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_unknown_key_in_a_config_file_names_the_file(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("batchsize = 3\n")
    with pytest.raises(ConfigError, match=r"c\.py: unknown config key 'batchsize'.*batch_size"):
        configure(DEFAULTS, [str(f)])


def test_file_sha256_matches_hashlib(tmp_path):
    f = tmp_path / "blob"
    data = os.urandom(3 << 20)  # spans several read blocks
    f.write_bytes(data)
    assert file_sha256(str(f)) == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("text", ['"""Doc"""', "42", "None", "'quoted'", "[1, 2]", "a=b", ""])
def test_a_string_key_keeps_the_text_exactly_as_typed(text):
    """A prompt is text, not Python: reading it as a literal lost the quotes of '\"\"\"Doc\"\"\"',
    made 42 an int (a type error) and None a crash further on."""
    assert configure({"start": "\n"}, [f"--start={text}"])["start"] == text


@pytest.mark.parametrize("argv,words", [
    (["--batch_size=None"], ["batch_size", "int"]),
    (["--learning_rate=(1, 2)"], ["learning_rate", "single float"]),
    (["--compile=[True]"], ["compile", "single bool"]),
])
def test_none_or_a_sequence_for_a_number_is_an_error(argv, words):
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, argv)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("line", ["batch_size = (8, 16)", "device = ['cpu']",
                                  "learning_rate = {'a': 1}"])
def test_a_sequence_for_a_known_key_in_a_config_file_is_an_error(tmp_path, line):
    """Non-scalar values used to be skipped silently (as if they were helper objects), so the
    run went ahead with the default."""
    f = tmp_path / "c.py"
    f.write_text(line + "\nhelpers = [1, 2]\n")  # an unknown helper list is still fine
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, [str(f)])
    msg = str(e.value)
    assert "\n" not in msg and "c.py" in msg and line.split()[0] in msg, msg


@pytest.mark.parametrize("argv", [["--learning_rate=1e999"], ["--learning_rate=-1e999"],
                                  [f"--learning_rate={10 ** 400}"], ["FILE:learning_rate = float('nan')"],
                                  ["--learning_rate=inf"], ["--learning_rate=-inf"],
                                  ["--learning_rate=nan"], ["--learning_rate=Infinity"]])
def test_a_float_that_is_not_finite_is_one_line_naming_the_key(tmp_path, argv):
    """1e999 reads as inf: --learning_rate=1e999 trained one step and logged "lr": Infinity,
    --rope_base=1e999 exported invalid JSON. Every float key refuses inf and nan in one place,
    typed as names too (`--learning_rate=inf` is a float, not an unreadable value)."""
    f = tmp_path / "c.py"
    if argv[0].startswith("FILE:"):
        f.write_text(argv[0][5:] + "\n")
        argv = [str(f)]
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, argv)
    assert "\n" not in str(e.value) and "learning_rate" in str(e.value) and "finite" in str(e.value)
    assert configure(DEFAULTS, ["--learning_rate=1e308"])["learning_rate"] == 1e308


def test_under_torchrun_each_distinct_error_line_is_said_once(monkeypatch, capsys):
    """Every rank used to print the same mistake. The reference is a launcher's store made
    here, as torchrun's agent makes it: the first rank to report a line prints it, a rank
    with the same line does not, and a line only another rank hits is still printed."""
    import datetime
    from torch.distributed import TCPStore
    from harness import common
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for rank, msg in [(0, "bad flag"), (1, "bad flag"), (1, "only rank 1 cannot read x")]:
        monkeypatch.setenv("RANK", str(rank))
        common.excepthook(ConfigError, ConfigError(msg), None)
    assert capsys.readouterr().err.splitlines() == ["error: bad flag",
                                                    "error: only rank 1 cannot read x"]


def test_error_line_only_formats_and_a_failed_command_cleans_up(tmp_path, monkeypatch):
    """error_line used to delete the folders the command made: formatting a line must touch no
    file. The reference is the filesystem: the folder made (holding only its created file)
    survives error_line, and goes once a command fails through cli, as it did before."""
    from harness import common
    made = tmp_path / "out"
    made.mkdir()
    (made / ".train.lock").write_text("1\n")
    monkeypatch.setattr(common, "created_dirs", [str(made)])
    monkeypatch.setattr(common, "created_files", [str(made / ".train.lock")])
    assert common.error_line("bad flag") == "error: bad flag" and made.is_dir()

    def main(argv):
        raise ConfigError("bad flag")
    with pytest.raises(SystemExit, match="^error: bad flag$"):
        common.cli(main)([])
    assert not made.exists()


def test_auto_dtype_does_not_count_emulated_bf16(monkeypatch):
    """torch 2.13's is_bf16_supported() is True on a T4 or V100, where bf16 is only emulated
    (several times slower): dtype=auto must pick fp16 there, and bf16 only where it is native.
    Checked against a stand-in for torch's query, since no GPU runs these tests."""
    import torch
    from harness.device import cuda_autocast_dtype
    for native, want in ((False, "float16"), (True, "bfloat16")):
        def query(including_emulation=True, native=native):
            return native or including_emulation  # emulation always "works"
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", query)
        assert cuda_autocast_dtype() == want


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A10", 125), ("NVIDIA A10G", None),
    ("NVIDIA L4", 121), ("NVIDIA L40", 181), ("NVIDIA L40S", 362), ("Tesla T4", 65),
    ("Tesla V100-PCIE-16GB", 112), ("NVIDIA GeForce RTX 4090", None),
])
def test_gpu_peak_matches_the_exact_model(name, tflops):
    """Substring matching gave an A10G the A10's peak and an L40 or L40S the L4's; an H100
    PCIe (756 TFLOP/s dense bf16) is not an SXM part (989). Unknown cards get None (mfu n/a).
    The expected values are the vendors' datasheet figures, written out here."""
    from harness.mfu import gpu_peak_flops
    got = gpu_peak_flops(name)
    assert (got is None and tflops is None) or got == tflops * 1e12


@pytest.mark.parametrize("text,line,words", [
    ("batch_size = 8\nlearning_rate = (1e-3\n", 2, ["syntax error"]),
    ("batch_size = 8\nimport math\nlearning_rate = math.sqrt(-1)\n", 3,
     ["ValueError", "math domain error"]),
    ("batch_size = 8\nraise RuntimeError('not this machine')\n", 2,
     ["RuntimeError", "not this machine"]),
])
def test_a_config_file_that_fails_is_one_line_naming_the_file_and_line(tmp_path, text, line,
                                                                       words):
    """A syntax error or an exception in a config file used to be a traceback."""
    f = tmp_path / "c.py"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, [str(f)])
    msg = str(e.value)
    assert "\n" not in msg and str(f) in msg and f"line {line}" in msg, msg
    assert all(w in msg for w in words), msg


def test_gpu_peak_depends_on_the_dtype_that_runs():
    """MFU of an fp32 run (TF32 tensor cores, allowed by train.py) is measured against the
    card's TF32 rate, not its bf16 rate; fp16/bf16 against the 16-bit rate; a dtype a card only
    emulates (bf16 on a T4 or V100) has no peak. Datasheet figures (dense), written out here."""
    from harness.mfu import GPU_PEAK_FLOPS, gpu_peak_flops
    datasheet = {"NVIDIA H100 80GB HBM3": (989, 494.5), "NVIDIA A100-SXM4-80GB": (312, 156),
                 "NVIDIA L4": (121, 60), "NVIDIA H100 PCIe": (756, 378)}
    for name, (half, tf32) in datasheet.items():
        assert gpu_peak_flops(name, "bfloat16") == gpu_peak_flops(name, "float16") == half * 1e12
        assert gpu_peak_flops(name, "float32") == tf32 * 1e12
    assert gpu_peak_flops("Tesla T4", "bfloat16") is None
    assert gpu_peak_flops("Tesla T4", "float16") == 65e12
    assert gpu_peak_flops("Tesla T4", "float32") == 8.1e12  # no TF32 before Ampere
    for key in GPU_PEAK_FLOPS:  # every card: fp32 below its 16-bit tensor-core rate
        name = " ".join(key)
        assert gpu_peak_flops(name, "float32") < gpu_peak_flops(name, "float16")


# --- what the README says about running things ---------------------------------------------

def readme():
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "README.md")) as f:
        return f.read()


def test_the_readme_says_whose_the_omp_num_threads_warning_is_and_how_to_silence_it():
    """Issue 45: torchrun warns about OMP_NUM_THREADS on every launch, before train.py runs
    (so train.py cannot set it). The README quotes torchrun's own warning and the way to
    silence it."""
    import inspect
    import torch.distributed.run as torchrun
    text = readme()
    quoted = re.search(r'"(Setting OMP_NUM_THREADS[^".]*?) \.\.\.', text)
    assert quoted and quoted.group(1) in inspect.getsource(torchrun), quoted
    assert "`OMP_NUM_THREADS=1 torchrun" in text


def test_the_readme_names_the_tests_that_skip_and_why():
    """Issue 45: the README said "so every test runs" while some always skip. Its Tests section
    (the test command links to it) names each kind of test that skips on a CPU machine with
    requirements-test.txt installed, with its reason: llama.cpp not installed, a --model option
    not given, no CUDA device, a tmpfs that cannot be mounted or root writing to a read-only
    folder."""
    text = readme()
    assert "[Tests](#tests)" in text[:text.index("pip install -r requirements-test.txt")]
    para = text[text.index("\n## Tests\n"):]
    for words in ("llama-cpp-python", "tests/test_contract.py", "--model", "CUDA", "tmpfs",
                  "read-only"):
        assert words in para, words


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("script", ["train.py", "sample.py", "eval.py", "export.py",
                                    "bench/speed/train_speed.py", "bench/speed/default_run.py"])
def test_help_says_what_the_script_does_its_keys_and_where_the_docs_are(script, flag,
                                                                        monkeypatch, capsys):
    """Issue 60 item 17: `--help` was "unknown config key 'help'" (and -h "config file not
    found"). It prints the script's docstring, every key with its default (the comment beside
    it in the script, where there is one) and where the docs are, and exits 0 before loading
    anything. The script runs as `python SCRIPT --help` would run it, in this process."""
    import ast
    import runpy
    path = os.path.join(ROOT, script)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    monkeypatch.setattr(sys, "argv", [path, "--out_dir=nowhere", flag])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # train.py sets its own
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        runpy.run_path(path, run_name="__main__")
    out = capsys.readouterr().out
    assert e.value.code in (0, None), e.value.code
    assert out.startswith(f"usage: python {script} [config.py ...] [--key=value ...]\n"), out
    first = ast.get_docstring(ast.parse(source)).strip().splitlines()[0]
    assert first in out
    keys = re.findall(r"^  (\w+) = (.+?)(?:  +# (.*))?$", out, re.M)
    assert ("out_dir", "'out'", "") in keys or script.startswith("bench/"), keys
    for name, default, comment in keys:  # each a key the script (or model.py) defines
        assert re.search(rf"\b{name}\b", source + model_source()), name
        if comment:  # the comment on the line that assigns it
            assert re.search(rf"^ *{name}\b.*# {re.escape(comment.split('  ')[0][:40])}",
                             source + model_source(), re.M), (name, comment)
    assert len(keys) >= 4
    assert "docs: README.md" in out and "HACKING.md" in out
    with pytest.raises(ConfigError, match="unknown config key 'help'"):  # no script: a key
        configure(DEFAULTS, ["--help"])


def model_source():
    with open(os.path.join(ROOT, "model.py"), encoding="utf-8") as f:
        return f.read()
