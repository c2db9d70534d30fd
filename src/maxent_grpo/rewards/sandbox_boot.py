"""The first code that runs inside the sandbox process, as (namespace) root.

`sandbox.py` passes this file's source to `python -I -S -c`, with the settings
as JSON in argv[1] and the untrusted program in a file in the working directory. It hides and locks the
filesystem (where a mount namespace exists), sets the resource limits, drops to
the sandbox uid (where the caller is root), and only then runs the program, in a
fresh `__main__` so the program does not see these settings. It imports nothing
from maxent_grpo: the package may lie in a directory the sandbox hides.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import types

MS_NOSUID, MS_NODEV, MS_BIND = 2, 4, 4096
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY = 1
OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH = 1, 4
# Syscall numbers of the new mount API: one table for x86_64 and aarch64 since Linux 5.x.
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38


class MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox setup: {what}: {os.strerror(err)}")
    return result


def _mount_tmpfs(libc, path: str, options: str) -> None:
    _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV), options.encode()),
           f"tmpfs on {path}")


def _isolate_filesystem(libc, cfg: dict) -> None:
    # 1. The whole host tree read-only, for this mount namespace only (unshare made it private).
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)),
           "read-only /")
    # 2. Detached copies of what must stay visible below a hidden or scratch directory (the interpreter).
    clones = [(path, _check(libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), OPEN_TREE_CLONE | AT_RECURSIVE),
                            f"open_tree {path}")) for path in cfg["keep"]]
    # 3. Home directories hidden.
    for path in cfg["hidden"]:
        if os.path.isdir(path):
            _mount_tmpfs(libc, path, "size=1m,mode=0755")
    # 4. One private tmpfs of tmpfs_mb for all scratch space: on /tmp, with its folders bound
    # on /var/tmp, /dev/shm, ... and on the working directory, so together they hold tmpfs_mb.
    root, *others = cfg["scratch"]
    _mount_tmpfs(libc, root, f"size={cfg['tmpfs_mb']}m,mode=1777")
    workdir = cfg["workdir"]
    binds = [(path, f"{root}/.{path.strip('/').replace('/', '-')}", 0o1777) for path in others if os.path.isdir(path)]
    if not workdir.startswith(root + "/"):
        binds.append((workdir, f"{root}/.workdir", 0o700))
    for target, source, mode in binds:
        os.mkdir(source, mode)
        os.chmod(source, mode)  # mkdir's mode passes through the umask
        os.makedirs(target, exist_ok=True)  # a working directory below a hidden one must be made again
        _check(libc.mount(source.encode(), target.encode(), None, ctypes.c_ulong(MS_BIND), None), f"bind {target}")
    os.makedirs(workdir, mode=0o700, exist_ok=True)
    # 5. What had to stay visible, back in place (read-only, as cloned).
    for path, fd in clones:
        os.makedirs(path, exist_ok=True)
        _check(libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, path.encode(), MOVE_MOUNT_F_EMPTY_PATH),
               f"move_mount {path}")
        os.close(fd)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    program_path = os.path.join(cfg["workdir"], cfg["program"])
    with open(program_path, encoding="utf-8") as f:
        program = f.read()
    os.unlink(program_path)  # the working directory is empty when the program starts
    libc = ctypes.CDLL(None, use_errno=True)
    if cfg["filesystem"]:
        _isolate_filesystem(libc, cfg)
    uid = cfg["uid"]
    if uid is not None:
        os.chown(cfg["workdir"], uid, uid)
    os.chdir(cfg["workdir"])
    limits = cfg["limits"]
    for which, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_AS, limits["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, limits["file_bytes"]), (resource.RLIMIT_NPROC, limits["processes"]),
                         (resource.RLIMIT_NOFILE, limits["open_files"])):
        resource.setrlimit(which, (value, value))
    # The soft limit sends SIGXCPU, which a namespace's pid 1 ignores; the hard one kills.
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    # setuid programs (su, mount, ...) cannot give the code back what is dropped below.
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if uid is not None:
        # A fresh uid: no other process shares it, so RLIMIT_NPROC (counted per uid) bounds
        # this run alone, and root's files and hard limits are out of reach.
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        # Changing uid clears the parent-death signal (unshare's --kill-child, setpriv's
        # --pdeathsig): set it again, so this process still dies with its parent.
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    del cfg, limits, libc
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = module
    sys.argv = ["<sandbox>"]
    exec(compile(program, "<sandbox>", "exec"), module.__dict__)


main()
