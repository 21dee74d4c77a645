"""Runs a command (argv[1:]) as uid = gid $AS (e.g. 64221), in a user namespace where every uid
maps to itself but no further user namespace may be made (user.max_user_namespaces = 0 in it):
a machine without unprivileged user namespaces, for one process tree (issue 32's fail-closed
test). Needs root (it writes the child's uid and gid maps). ctypes for unshare(2): Python 3.11
has no os.unshare."""

import ctypes
import os
import sys

CLONE_NEWUSER = 0x10000000
libc = ctypes.CDLL(None, use_errno=True)
uid = int(os.environ.pop("AS"))
r, w = os.pipe()
r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w)
    os.close(r2)
    if libc.unshare(CLONE_NEWUSER) != 0:
        e = ctypes.get_errno()
        sys.exit("unshare: " + os.strerror(e))
    os.write(w2, b"u")
    os.close(w2)
    os.read(r, 1)
    os.close(r)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    # It dies with this process (the test stops it by killing this one); set after setuid,
    # which clears it.
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    os.execvp(sys.argv[1], sys.argv[1:])
os.close(r)
os.close(w2)
os.read(r2, 1)
for f in ("uid_map", "gid_map"):
    with open("/proc/%d/%s" % (pid, f), "w") as fh:
        fh.write("0 0 4294967295\n")
os.write(w, b"g")
os.close(w)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
