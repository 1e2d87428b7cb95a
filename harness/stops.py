"""What stops a run: SIGTERM/SIGINT (finish the step, save, exit 0), a loss that is not finite
(stop without saving), and the command that resumes it after."""
import math
import os
import shlex
import signal

from harness.common import UserError


def stop_on_signals():
    """SIGTERM/SIGINT: finish the step in flight, save, exit 0; a second Ctrl-C stops at once,
    a second SIGTERM does not (a launcher's death can deliver two, and the second would kill
    the save in flight). Returns a list that is non-empty once a signal came."""
    stop = []

    def on_signal(signum, frame):
        stop.append(signum)
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    return stop


def diverged(what, iter_num, ckpt_path):
    """The line that stops a run whose loss (`what`: the step's, or an evaluation's) at
    iter_num is not finite: nothing is saved, so the checkpoint named (if any) holds the last
    weights whose evaluation was finite."""
    if os.path.exists(ckpt_path):
        kept = (f"the last good checkpoint is {ckpt_path}: resume from it with a lower "
                f"--learning_rate (or --grad_clip=1) and --init_from=resume")
    else:
        kept = ("no checkpoint was saved: start again with a lower --learning_rate (or "
                "--grad_clip=1)")
    return f"non-finite loss at iteration {iter_num} ({what}); stopping without saving ({kept})"


def stop_if_diverged(losses, iter_num, ckpt_path, progress):
    """An evaluation whose loss ({split: loss}) is not finite stops the run before it is logged
    or saved: saved, its checkpoint would be the one the next error calls the last good one."""
    if all(map(math.isfinite, losses.values())):
        return
    progress.close(iter_num)
    raise UserError(diverged(f"evaluation: train {losses['train']:.4g}, val "
                             f"{losses['val']:.4g}", iter_num, ckpt_path))


def resume_command(argv, ddp):
    """The command that continues this run after a stop: this one with --init_from=resume in
    place of any init_from it gave (under torchrun, which launches it from outside, said)."""
    if ddp:
        return "this torchrun command and --init_from=resume"
    args = [a for a in argv[1:] if not a.startswith("--init_from=")]
    return "python " + shlex.join([argv[0], *args, "--init_from=resume"])
