"""A minimal MCP server over stdio (one JSON-RPC message per line) whose tools take arguments a
policy decides on: `post {channel, text}`, `transfer {amount, to, memo: {note}}` and `rename`,
which renames `post`'s `channel` argument to `room` and announces
`notifications/tools/list_changed` (an upstream whose schema drifts mid-run). Each call that
reaches it is appended to the file named by CHATBANK_LOG, as `tool json-arguments`.

Used by the tests of typed arguments (`context.arguments`).
Usage: python3 chatbank.py
"""
import json
import os
import sys

renamed = False


def tools():
    where = "room" if renamed else "channel"
    return [
        {
            "name": "post",
            "description": "Posts `text` to a channel.",
            "inputSchema": {
                "type": "object",
                "properties": {where: {"type": "string"}, "text": {"type": "string"}},
                "required": [where, "text"],
            },
        },
        {
            "name": "transfer",
            "description": "Transfers `amount` to `to`.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "amount": {"type": "integer"},
                    "to": {"type": "string"},
                    "memo": {"type": "object", "properties": {"note": {"type": "string"}}},
                    "rate": {"type": "number"},
                },
                "required": ["amount", "to"],
            },
        },
        {
            "name": "rename",
            "description": "Renames post's channel argument to room.",
            "inputSchema": {"type": "object", "properties": {}},
        },
    ]


def send(msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def answer(id, result=None, error=None):
    msg = {"jsonrpc": "2.0", "id": id}
    if error is not None:
        msg["error"] = error
    else:
        msg["result"] = result
    send(msg)


def call(id, params):
    global renamed
    name, args = params.get("name"), params.get("arguments") or {}
    with open(os.environ["CHATBANK_LOG"], "a") as log:
        log.write(name + " " + json.dumps(args, sort_keys=True) + "\n")
    if name == "rename":
        renamed = True
        answer(id, {"content": [{"type": "text", "text": "renamed"}]})
        send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        return
    answer(id, {"content": [{"type": "text", "text": "done: " + json.dumps(args, sort_keys=True)}]})


def main():
    for line in sys.stdin:
        msg = json.loads(line)
        method, id = msg.get("method"), msg.get("id")
        if id is None:
            continue
        if method == "initialize":
            version = msg.get("params", {}).get("protocolVersion", "2025-06-18")
            answer(id, {"protocolVersion": version,
                        "capabilities": {"tools": {"listChanged": True}},
                        "serverInfo": {"name": "chatbank", "version": "1"}})
        elif method == "tools/list":
            answer(id, {"tools": tools()})
        elif method == "tools/call":
            call(id, msg.get("params", {}))
        elif method == "ping":
            answer(id, {})
        else:
            answer(id, error={"code": -32601, "message": "method not found"})


main()
