"""A minimal MCP server over stdio (one JSON-RPC message per line) with one tool, `read_joined`,
that reads `os.path.join(dir, name)`, as many real servers join a folder and a name. Each path
it opens is appended to the file named by JOINER_LOG.

Used by the tests to check that a two-argument template is decided on what the server opens.
Usage: python3 joiner.py
"""
import json
import os
import sys

TOOL = {
    "name": "read_joined",
    "description": "Reads the file `name` in the folder `dir`.",
    "inputSchema": {
        "type": "object",
        "properties": {"dir": {"type": "string"}, "name": {"type": "string"}},
        "required": ["dir", "name"],
    },
    "annotations": {"readOnlyHint": True},
}


def answer(id, result=None, error=None):
    msg = {"jsonrpc": "2.0", "id": id}
    if error is not None:
        msg["error"] = error
    else:
        msg["result"] = result
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def call(params):
    args = params.get("arguments") or {}
    path = os.path.join(args.get("dir", ""), args.get("name", ""))
    with open(os.environ["JOINER_LOG"], "a") as log:
        log.write(path + "\n")
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        return {"content": [{"type": "text", "text": str(e)}], "isError": True}
    return {"content": [{"type": "text", "text": text}]}


def main():
    for line in sys.stdin:
        msg = json.loads(line)
        method, id = msg.get("method"), msg.get("id")
        if id is None:
            continue
        if method == "initialize":
            version = msg.get("params", {}).get("protocolVersion", "2025-06-18")
            answer(id, {"protocolVersion": version, "capabilities": {"tools": {}},
                        "serverInfo": {"name": "joiner", "version": "1"}})
        elif method == "tools/list":
            answer(id, {"tools": [TOOL]})
        elif method == "tools/call":
            answer(id, call(msg.get("params", {})))
        elif method == "ping":
            answer(id, {})
        else:
            answer(id, error={"code": -32601, "message": "method not found"})


main()
