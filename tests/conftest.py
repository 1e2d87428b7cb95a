"""The --model option of tests/test_contract.py: `--model KEY=VALUE`, repeated, one field of
RoFormerConfig each, read the way train.py reads `--KEY=VALUE` (harness/flags.py's configure against the
field's default), on top of a tiny base configuration. Other test files ignore it."""
import dataclasses
import os
import sys

import pytest

# The suite checks the CPU paths against CPU references (float32 where it compares numbers).
# On a machine with a GPU, device=auto would pick it (and bf16) in the scripts the tests run,
# and two-rank tests would ask for a second GPU, so CUDA is hidden from the tests and their
# subprocesses, before torch is imported. ROFORMER_TEST_CUDA=1 keeps it, for the tests that
# need a GPU (tests/test_train.py's pinned batches: bench/cuda_check.sh runs them).
if os.environ.get("ROFORMER_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the tiny model every contract check builds; --model overrides any of these. 4 layers: an
# option that acts on every k-th layer (k = 2, 3, 4) builds both kinds of layer
CONTRACT_BASE = dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32,
                     linear_chunk=4)


def deep_enough(overrides):
    """n_layer for the check's model: k + 1 layers for any `*_every=k` option, so whether the
    option counts layers from 0 (0, k, ..) or from 1 (k-1, 2k-1, ..) it selects a layer and
    leaves one; an n_layer given with --model is kept (and an inert option then shows)."""
    every = [v for k, v in overrides.items() if k.endswith("_every") and isinstance(v, int)]
    return max([CONTRACT_BASE["n_layer"]] + [k + 1 for k in every])


def pytest_addoption(parser):
    parser.addoption("--model", action="append", default=[], metavar="KEY=VALUE",
                     help="tests/test_contract.py: a RoFormerConfig field for the model it "
                          "checks (repeat for several), e.g. --model attention=linear")


def contract_overrides(values):
    """['k=v', ...] -> {k: value} typed like RoFormerConfig's defaults, and the RoFormerConfig
    they make on the tiny base; a mistake is a pytest.UsageError in one line."""
    from harness.common import UserError
    from harness.flags import configure
    from model import RoFormerConfig
    defaults = {f.name: f.default for f in dataclasses.fields(RoFormerConfig)}
    try:
        typed = configure(defaults, ["--" + v for v in values])
    except UserError as e:
        near = "unknown" not in str(e) or "did you mean" in str(e)
        fields = "" if near else f" (RoFormerConfig's fields: {', '.join(sorted(defaults))})"
        raise pytest.UsageError(f"--model: {e}{fields}") from None
    overrides = {k: typed[k] for k in (v.partition("=")[0] for v in values)}
    try:
        cfg = RoFormerConfig(**{**CONTRACT_BASE, "n_layer": deep_enough(overrides),
                                 **overrides})
    except (TypeError, ValueError) as e:
        raise pytest.UsageError(f"--model: not a valid configuration: {e}") from None
    return overrides, cfg


ATTENTIONS = ("softmax", "linear")  # the model's two attentions: every default run checks both


def contract_runs(values):
    """[(id, cfg)]: the configurations the contract tests run on, each test once per entry, and
    a note for the header. Without attention= among the --model values, both attentions: a
    change to the shared parts (or a kernel's bug) reaches both, and the default run on softmax
    alone passed an eq. 19 kernel that saw the future (docs/HACKING.md). An option that
    linear attention refuses (qk_norm, ...) leaves the softmax half, and the note says why."""
    if any(v.partition("=")[0] == "attention" for v in values):
        cfg = contract_overrides(values)[1]
        return [(cfg.attention, cfg)], ""
    runs, note = [], ""
    for attention in ATTENTIONS:
        try:
            runs.append((attention, contract_overrides(values + [f"attention={attention}"])[1]))
        except pytest.UsageError as e:
            if not runs:  # softmax, today's default: the options' own mistake
                raise
            note = f"; attention={attention} not checked: {str(e).partition(': ')[2]}"
    return runs, note


def pytest_configure(config):
    config.contract_cfg, config.contract_overrides = None, {}
    if config.getoption("model"):  # checked now, so a typo stops the run before any test
        config.contract_overrides, config.contract_cfg = contract_overrides(
            config.getoption("model"))
    config.contract_runs, config.contract_note = contract_runs(config.getoption("model"))
    global CONTRACT_RUNS  # for the self-tests: a configuration the run checks reports itself
    CONTRACT_RUNS = config.contract_runs


def pytest_report_header(config):
    if config.contract_cfg is not None:
        return "contract check on: " + " ".join(f"{k}={v!r}" for k, v in
                                                config.contract_overrides.items()) + \
            " (attention: " + ", ".join(i for i, _ in config.contract_runs) + ")" + \
            config.contract_note


def pytest_generate_tests(metafunc):
    """contract_cfg: each contract test once per configuration of the run (contract_runs)."""
    if "contract_cfg" in metafunc.fixturenames:
        runs = metafunc.config.contract_runs
        metafunc.parametrize("contract_cfg", [cfg for _, cfg in runs],
                             ids=[i for i, _ in runs])


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Every test in one torch thread. The tests' models are tiny: a second thread only adds
    its hand-off, and on a loaded 2-core machine (CI, shared hosts) it waits for a core at
    every op, which made in-process tests up to 100x slower (tests/test_model.py's overfit
    test: 28 s on 2 threads, 0.2 s on 1, at load 2). Subprocesses choose their own (train.py's
    tests pass OMP_NUM_THREADS=1)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
