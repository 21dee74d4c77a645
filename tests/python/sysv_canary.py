"""SysV IPC canaries for the sandbox's IPC namespace (issue 42): makes a shared-memory segment
holding "the shm canary" and a message queue holding one message "the msg canary", both mode
0600 of the uid it runs under, prints `{"shm": [key, id], "msg": [key, id]}` on one line, waits
for its standard input to close, then prints `{"shm": "...", "queued": N}` (what the segment
still holds and how many messages are still queued) and removes both. Standard library only
(ctypes)."""

import ctypes
import ctypes.util
import json
import os
import sys

IPC_CREAT, IPC_EXCL, IPC_RMID, IPC_STAT = 0o1000, 0o2000, 0, 2

lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
lib.shmat.restype = ctypes.c_void_p
lib.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]


def check(n, what):
    if n is None or n < 0:
        e = ctypes.get_errno()
        sys.exit("%s: %s" % (what, os.strerror(e)))
    return n


base = int.from_bytes(os.urandom(3), "big") + 0x5A000000
shm_key, msg_key = base, base + 1
shm = check(lib.shmget(shm_key, 4096, IPC_CREAT | IPC_EXCL | 0o600), "shmget")
addr = lib.shmat(shm, None, 0)
if addr == ctypes.c_void_p(-1).value:
    check(-1, "shmat")
ctypes.memmove(addr, b"the shm canary\0", 15)
msg = check(lib.msgget(msg_key, IPC_CREAT | IPC_EXCL | 0o600), "msgget")
body = b"the msg canary"
buf = ctypes.create_string_buffer(8 + len(body))
ctypes.memmove(buf, (1).to_bytes(8, sys.byteorder) + body, 8 + len(body))
check(lib.msgsnd(msg, buf, len(body), 0), "msgsnd")
print(json.dumps({"shm": [shm_key, shm], "msg": [msg_key, msg]}), flush=True)
sys.stdin.read()
held = ctypes.string_at(addr, 32).split(b"\0")[0].decode()
# struct msqid_ds (64-bit glibc), read through IPC_STAT: ipc_perm (48 bytes), msg_stime,
# msg_rtime, msg_ctime, __msg_cbytes (8 each), then msg_qnum (8).
ds = ctypes.create_string_buffer(256)
check(lib.msgctl(msg, IPC_STAT, ds), "msgctl")
queued = int.from_bytes(ds.raw[48 + 8 * 4 : 48 + 8 * 5], sys.byteorder)
print(json.dumps({"shm": held, "queued": queued}), flush=True)
lib.shmdt(ctypes.c_void_p(addr))
lib.shmctl(shm, IPC_RMID, None)
lib.msgctl(msg, IPC_RMID, None)
