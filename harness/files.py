"""Files: atomic writes (a temp file or folder, fsync, rename, fsync the folder) and the out_dir
check. Imports of the project only harness/common.py (UserError, and the list of folders a failed
command removes), and no torch: data/'s workers import it."""
import os
import shutil

from harness.common import UserError, created_dirs


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
