"""A brokered MCP server that floods its client (issue 31, item 11): plain JSON-RPC over stdio,
no library. Once it has answered its first tools/list it sends FLOOD (default 20,000)
notifications/tools/list_changed and as many notifications/message, each message carrying a
newline and a would-be log line of its own, and as many lines on its stderr; then it goes on
serving: tools/list (one tool, `echo`, the same list every time) and tools/call (echo's text).
"""

import json
import os
import sys

FLOOD = int(os.environ.get("FLOOD", "20000"))
TOOLS = [
    {
        "name": "echo",
        "description": "Echoes its text.",
        "inputSchema": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    }
]


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def flood():
    lines = []
    for i in range(FLOOD):
        lines.append(json.dumps({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}))
        lines.append(
            json.dumps(
                {
                    "jsonrpc": "2.0",
                    "method": "notifications/message",
                    "params": {
                        "level": ["debug", "info", "warning", "error", "emergency"][i % 5],
                        "logger": "noisy",
                        "data": "message %d\nERROR FORGED-LINE %s" % (i, "x" * 300),
                    },
                }
            )
        )
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    sys.stderr.write("".join("stderr line %d FORGED-STDERR %s\n" % (i, "y" * 300) for i in range(FLOOD)))
    sys.stderr.flush()


flooded = False
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
                    "capabilities": {"tools": {"listChanged": True}, "logging": {}},
                    "serverInfo": {"name": "noisy", "version": "1"},
                },
            }
        )
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": ident, "result": {"tools": TOOLS}})
        if not flooded:
            flooded = True
            flood()
    elif method == "tools/call":
        text = message["params"].get("arguments", {}).get("text", "")
        send({"jsonrpc": "2.0", "id": ident, "result": {"content": [{"type": "text", "text": text}]}})
    elif ident is not None:
        send({"jsonrpc": "2.0", "id": ident, "error": {"code": -32601, "message": "not here"}})
