"""train.py with a hard crash, for the restart tests: `crash_train.py ITER:RANK ARGS...` runs
train.py ARGS (runpy) and, on the first attempt under torchrun (restart 0), kills rank RANK
with os._exit at iteration ITER, before its update (after its checkpoint, if one is due): so
torchrun --max-restarts must resume what the last checkpoint holds."""
import os
import runpy
import sys

from torch.optim.optimizer import register_optimizer_step_pre_hook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
at, rank = map(int, sys.argv[1].split(":"))
if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0 and int(os.environ["RANK"]) == rank:
    steps = []

    def crash(optimizer, args, kwargs):  # before every optimizer step, iteration `len(steps)`
        if len(steps) == at:
            os._exit(17)
        steps.append(1)
    register_optimizer_step_pre_hook(crash)
sys.argv = [os.path.join(ROOT, "train.py")] + sys.argv[2:]
sys.path.insert(0, ROOT)
runpy.run_path(sys.argv[0], run_name="__main__")
