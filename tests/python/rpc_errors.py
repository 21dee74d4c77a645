"""A brokered MCP server whose tools/call answers are JSON-RPC errors, as an ordinary server's
are (issue 42, item 11): plain JSON-RPC over stdio, no library. Tools: `bad_args` answers
-32602 (invalid params); `busy` answers -32000 (a server error) whose message carries the
secret it was given ($TOKEN), a newline and 2,000 more characters; `echo` answers its text.
"""

import json
import os
import sys

TOKEN = os.environ.get("TOKEN", "")
TOOLS = [
    {
        "name": name,
        "description": name,
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
    }
    for name in ("bad_args", "busy", "echo")
]


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


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
                    "serverInfo": {"name": "rpc-errors", "version": "1"},
                },
            }
        )
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": ident, "result": {"tools": TOOLS}})
    elif method == "tools/call":
        name = message["params"].get("name")
        text = message["params"].get("arguments", {}).get("text", "")
        if name == "bad_args":
            error = {"code": -32602, "message": "Invalid params: `text` must be a number"}
            send({"jsonrpc": "2.0", "id": ident, "error": error})
        elif name == "busy":
            error = {
                "code": -32000,
                "message": "rate limited for token %s\nretry later %s" % (TOKEN, "z" * 2000),
                "data": {"token": TOKEN},
            }
            send({"jsonrpc": "2.0", "id": ident, "error": error})
        else:
            send({"jsonrpc": "2.0", "id": ident, "result": {"content": [{"type": "text", "text": text}]}})
    elif ident is not None:
        send({"jsonrpc": "2.0", "id": ident, "result": {}})
