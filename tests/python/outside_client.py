"""Drive sharedos-mcp-shim with the Python MCP SDK (PyPI mcp 2.3.0): an outside client.

Runs one session with each opening (legacy `initialize`, and `auto`, which first sends the
2026-07-28 `server/discover`), makes five calls in each, and prints a JSON report as the last
line. Exits non-zero on any transport error. Env: SHAREDOS_SHIM, SHAREDOS_TURN_TOKEN,
SHAREDOS_BROKER.
"""
import json
import os
import sys

import anyio
from mcp import Client, MCPError, StdioServerParameters


def first_text(result):
    return result.content[0].text if result.content else ""


async def session(mode):
    params = StdioServerParameters(command=os.environ["SHAREDOS_SHIM"], args=[], env=dict(os.environ))
    report = {}
    async with Client(params, mode=mode, read_timeout_seconds=20) as client:
        report["protocol"] = str(client.protocol_version)
        tools = await client.list_tools()
        report["tools"] = sorted(t.name for t in tools.tools)
        calls = {
            "public": ("files.read", {"path": "/public/hello.txt"}),
            "private": ("files.read", {"path": "/private/secret.txt"}),
            "traversal": ("files.read", {"path": "/public/../private/secret.txt"}),
            "unpublished": ("files.delete", {"path": "/public/hello.txt"}),
            "malformed": ("files read", {"path": "/public/hello.txt"}),
        }
        for key, (tool, args) in calls.items():
            result = await client.call_tool(tool, args)
            report[key] = [bool(result.is_error), first_text(result)]
            if key == "private":
                meta = result.meta or {}
                report["meta_code"] = (meta.get("sharedos") or {}).get("code")
    return report


async def main():
    out = {}
    for mode in ("legacy", "auto"):
        try:
            out[mode] = await session(mode)
        except MCPError as e:
            print(f"{mode}: JSON-RPC error {e.code}: {e}", file=sys.stderr)
            sys.exit(1)
    print(json.dumps(out))


anyio.run(main)
