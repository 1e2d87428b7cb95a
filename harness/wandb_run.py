"""wandb_log=True (wandb is optional: train.py imports this module only then)."""
import os

from harness.common import UserError


def check():
    """wandb_log=True: one line now, before out_dir exists, where wandb.init would fail later
    (no package, no login). Offline and disabled modes need no login. Nothing here goes online
    or prompts."""
    try:
        import wandb
    except ImportError:
        raise UserError("wandb_log=True needs the wandb package: pip install wandb")
    try:
        try:  # the mode from the environment and wandb's settings files (`wandb offline`)
            from wandb.sdk.wandb_setup import singleton
            mode = singleton().settings.mode
        except (ImportError, AttributeError):  # an older wandb: the environment's
            mode = os.environ.get("WANDB_MODE", "online")
        if mode in ("offline", "dryrun", "disabled"):
            return
        try:
            logged_in = wandb.login(prompt=False, verify=False)
        except TypeError:  # a wandb before login(prompt=...)
            logged_in = wandb.api.api_key is not None
    except (ValueError, wandb.errors.Error) as e:  # a malformed key or WANDB_MODE
        raise UserError(f"wandb_log=True: {str(e).splitlines()[0]}")
    if not logged_in:
        raise UserError("wandb_log=True but wandb has no login: run `wandb login` or set "
                        "WANDB_API_KEY, or log locally with WANDB_MODE=offline")
