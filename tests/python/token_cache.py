"""A per-principal brokered MCP server that keeps a token cache, as OAuth-using servers do
(issue 42, item 4): plain JSON-RPC over stdio, no library. Tools:
- `cache`: writes $TOKEN to $HOME/cache.json (0600) and reports its uid, $HOME, and the SHA-256
  of what the cache held before (a cache its principal's earlier instance left), if any;
- `peek` {paths}: reads each path (a file's text, a folder's listing, walked) and reports what it
  got or the error: what another principal's instance left is what it looks for;
- `echo` {text}: answers its text (what an upstream that leaks a value it found would send).
"""

import hashlib
import json
import os
import sys

TOOLS = [
    {"name": "cache", "description": "cache", "inputSchema": {"type": "object", "properties": {}}},
    {
        "name": "peek",
        "description": "peek",
        "inputSchema": {
            "type": "object",
            "properties": {"paths": {"type": "array", "items": {"type": "string"}}},
        },
    },
    {
        "name": "echo",
        "description": "echo",
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
    },
]


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def cache():
    home = os.environ.get("HOME", "")
    path = os.path.join(home, "cache.json")
    previous = None
    try:
        with open(path, "rb") as f:
            previous = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        pass
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"token": os.environ.get("TOKEN", "")}))
        wrote = "ok: " + path
    except OSError as e:
        wrote = "error: %s: %s" % (type(e).__name__, e)
    return {"uid": os.getuid(), "home": home, "wrote": wrote, "previous": previous}


def look(path):
    try:
        if os.path.isdir(path):
            found = {}
            for top, dirs, files in os.walk(path, onerror=lambda e: (_ for _ in ()).throw(e)):
                for name in files:
                    p = os.path.join(top, name)
                    try:
                        with open(p) as f:
                            found[p] = f.read()
                    except OSError as e:
                        found[p] = "error: %s" % type(e).__name__
            return "ok: " + json.dumps({"listing": sorted(os.listdir(path)), "files": found})
        with open(path) as f:
            return "ok: " + f.read()
    except OSError as e:
        return "error: %s: %s" % (type(e).__name__, e)


for line in sys.stdin:
    try:
        message = json.loads(line)
    except ValueError:
        continue
    method = message.get("method")
    ident = message.get("id")
    if method == "initialize":
        send(
            {
                "jsonrpc": "2.0",
                "id": ident,
                "result": {
                    "protocolVersion": message["params"]["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "token-cache", "version": "1"},
                },
            }
        )
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": ident, "result": {"tools": TOOLS}})
    elif method == "tools/call":
        name = message["params"].get("name")
        args = message["params"].get("arguments", {}) or {}
        if name == "cache":
            out = cache()
        elif name == "peek":
            out = {p: look(p) for p in args.get("paths", [])}
        else:
            out = args.get("text", "")
        text = out if isinstance(out, str) else json.dumps(out)
        send({"jsonrpc": "2.0", "id": ident, "result": {"content": [{"type": "text", "text": text}]}})
    elif ident is not None:
        send({"jsonrpc": "2.0", "id": ident, "result": {}})
