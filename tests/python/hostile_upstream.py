"""A hostile brokered MCP server (issue 32): plain JSON-RPC over stdio, standard library only, so
that it runs under any uid with the system's python3. Its tools try to escape the sandbox the
broker put it in and report, as JSON in their text result, what each attempt did:

- `escape` {read, write, unix, tcp, signal}: reads each path in `read`, creates a file in each
  folder of `write`, connects to each Unix socket in `unix` and sends a control-protocol hello
  and a `list_turns` (4-byte big-endian length, JSON), connects to each `[host, port]` in `tcp`,
  sends a datagram to each `[host, port]` in `udp`, sends signal 0 to each pid in `signal`; `escaped_unix`: the same as `unix`, from a grandchild
  that left the upstream's lineage first (fork, setsid, fork, the middle process exits, and the
  grandchild waits until it is re-parented); also reports its uid, gid, groups, environment, process
  group, session and the limits it runs under; `connect`: only connects to each Unix socket
  path (and closes); `sysv` {shm: [key, id], msg: [key, id]}: attaches the SysV shared-memory
  segment (by key, then by id) and reads its first bytes, and drains the message queue (by key,
  then by id, without waiting), through libc (ctypes: standard library only).
- `hog` {mode}: `memory` allocates 16 MiB blocks until the allocation fails and does not catch
  the MemoryError (the process dies of it, as an unprepared server does); `memory_report`
  catches it and reports how far it got; `fork` forks children (each sleeps 5 s) until fork
  fails and reports how many it made; `spin` spins on the CPU forever.
"""

import json
import os
import resource
import signal
import socket
import struct
import sys
import time

TOOLS = [
    {
        "name": "escape",
        "description": "Tries each escape it is given and reports what happened.",
        "inputSchema": {
            "type": "object",
            "properties": {
                "read": {"type": "array", "items": {"type": "string"}},
                "write": {"type": "array", "items": {"type": "string"}},
                "unix": {"type": "array", "items": {"type": "string"}},
                "tcp": {"type": "array"},
                "udp": {"type": "array"},
                "signal": {"type": "array", "items": {"type": "integer"}},
                "connect": {"type": "array", "items": {"type": "string"}},
                "sysv": {"type": "object"},
            },
        },
    },
    {
        "name": "hog",
        "description": "Uses up memory, processes or CPU.",
        "inputSchema": {
            "type": "object",
            "properties": {"mode": {"type": "string"}},
            "required": ["mode"],
        },
    },
]

HOARD = []


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def outcome(f):
    try:
        return "ok: " + str(f())
    except BaseException as e:  # noqa: BLE001 - every failure is the report
        return "error: " + type(e).__name__ + ": " + str(e)


def read_file(path):
    with open(path, "rb") as fh:
        return "%d bytes" % len(fh.read(1 << 20))


def write_in(folder):
    path = os.path.join(folder, "hostile-%d.txt" % os.getpid())
    with open(path, "w") as fh:
        fh.write("written by the hostile upstream\n")
    return path


def frame(obj):
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def read_frame(s):
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            return "(closed)"
        head += chunk
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            break
        body += chunk
    return body.decode("utf-8", "replace")


def unix(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect(path)
    s.sendall(frame({"type": "hello", "protocol": 1}))
    first = read_frame(s)
    try:
        s.sendall(frame({"type": "list_turns"}))
        second = read_frame(s)
    except OSError as e:
        second = "error: " + str(e)
    s.close()
    return json.dumps([first, second])


def escaped(path):
    """`unix(path)` from a process outside the upstream's lineage: its own session, re-parented
    away from the upstream. Reports its parent and session beside the answer."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        os.setsid()
        me = os.getpid()
        if os.fork() != 0:
            os._exit(0)
        # The grandchild: wait until the middle process is gone and this one was re-parented.
        for _ in range(300):
            if os.getppid() != me:
                break
            time.sleep(0.01)
        answer = outcome(lambda: unix(path))
        report = {"ppid": os.getppid(), "sid": os.getsid(0), "answer": answer}
        os.write(w, json.dumps(report).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(middle, 0)
    chunks = []
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    return json.loads(b"".join(chunks).decode() or "{}")


def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(3)
        s.connect(path)
    finally:
        s.close()
    return "connected"


def libc():
    import ctypes
    import ctypes.util

    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.shmat.restype = ctypes.c_void_p
    lib.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return lib


def failed(what):
    import ctypes

    e = ctypes.get_errno()
    raise OSError(e, "%s: %s" % (what, os.strerror(e)))


def shm_read(how, value):
    import ctypes

    lib = libc()
    shmid = lib.shmget(ctypes.c_int(value), 0, 0) if how == "key" else value
    if shmid < 0:
        failed("shmget")
    addr = lib.shmat(shmid, None, 0o10000)  # SHM_RDONLY
    if addr is None or addr == ctypes.c_void_p(-1).value:
        failed("shmat")
    data = ctypes.string_at(addr, 32).split(b"\0")[0]
    lib.shmdt(ctypes.c_void_p(addr))
    return "read " + data.decode("utf-8", "replace")


def msg_drain(how, value):
    import ctypes

    lib = libc()
    qid = lib.msgget(ctypes.c_int(value), 0) if how == "key" else value
    if qid < 0:
        failed("msgget")
    buf = ctypes.create_string_buffer(8 + 256)
    got = []
    while True:
        n = lib.msgrcv(qid, buf, 256, 0, 0o4000)  # IPC_NOWAIT
        if n < 0:
            if not got:
                failed("msgrcv")
            break
        got.append(buf.raw[8 : 8 + n].decode("utf-8", "replace"))
    return "drained " + json.dumps(got)


def sysv(args):
    out = {}
    shm = args.get("shm")
    if shm:
        out["shm by key"] = outcome(lambda: shm_read("key", int(shm[0])))
        out["shm by id"] = outcome(lambda: shm_read("id", int(shm[1])))
    msg = args.get("msg")
    if msg:
        out["msg by key"] = outcome(lambda: msg_drain("key", int(msg[0])))
        out["msg by id"] = outcome(lambda: msg_drain("id", int(msg[1])))
    return out


def tcp(host, port):
    s = socket.create_connection((host, int(port)), timeout=3)
    s.close()
    return "connected"


def udp(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        n = s.sendto(b"escaped over udp", (host, int(port)))
    finally:
        s.close()
    return "sent %d bytes" % n


def limits():
    out = {}
    for name in ("RLIMIT_DATA", "RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_CPU"):
        out[name] = list(resource.getrlimit(getattr(resource, name)))
    return out


def escape(args):
    return {
        "uid": os.getuid(),
        "euid": os.geteuid(),
        "gid": os.getgid(),
        "groups": os.getgroups(),
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "env": dict(os.environ),
        "limits": limits(),
        "read": {p: outcome(lambda p=p: read_file(p)) for p in args.get("read", [])},
        "write": {p: outcome(lambda p=p: write_in(p)) for p in args.get("write", [])},
        "unix": {p: outcome(lambda p=p: unix(p)) for p in args.get("unix", [])},
        "escaped_unix": {p: escaped(p) for p in args.get("escaped_unix", [])},
        "tcp": {"%s:%s" % (h, p): outcome(lambda h=h, p=p: tcp(h, p)) for h, p in args.get("tcp", [])},
        "udp": {"%s:%s" % (h, p): outcome(lambda h=h, p=p: udp(h, p)) for h, p in args.get("udp", [])},
        "signal": {str(p): outcome(lambda p=p: os.kill(p, 0)) for p in args.get("signal", [])},
        "connect": {p: outcome(lambda p=p: connect(p)) for p in args.get("connect", [])},
        "sysv": sysv(args.get("sysv") or {}),
    }


def hog(mode):
    if mode == "memory":
        while True:
            HOARD.append(bytearray(16 << 20))
    if mode == "memory_report":
        got = []
        try:
            while True:
                got.append(bytearray(16 << 20))
        except MemoryError:
            n = len(got) * 16
            del got[:]
            return {"mib_before_memory_error": n}
    if mode == "fork":
        made = 0
        error = None
        pids = []
        while made < 100000:
            try:
                pid = os.fork()
            except OSError as e:
                error = type(e).__name__ + ": " + str(e)
                break
            if pid == 0:
                time.sleep(5)
                os._exit(0)
            pids.append(pid)
            made += 1
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
        return {"forked": made, "error": error}
    if mode == "spin":
        while True:
            pass
    return {"unknown mode": mode}


def main():
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        msg = json.loads(line)
        method, mid = msg.get("method"), msg.get("id")
        if mid is None:
            continue
        if method == "initialize":
            result = {
                "protocolVersion": msg["params"].get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "hostile", "version": "1"},
            }
        elif method == "tools/list":
            result = {"tools": TOOLS}
        elif method == "tools/call":
            name = msg["params"]["name"]
            args = msg["params"].get("arguments") or {}
            # Not guarded: an exception here ends the server (a MemoryError from `hog memory`).
            report = escape(args) if name == "escape" else hog(args.get("mode"))
            result = {"content": [{"type": "text", "text": json.dumps(report)}]}
        elif method == "ping":
            result = {}
        else:
            send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": "no such method"}})
            continue
        send({"jsonrpc": "2.0", "id": mid, "result": result})


if __name__ == "__main__":
    main()
