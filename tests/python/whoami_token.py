"""A brokered MCP server written for the secrets tests (issue 33), on the Python MCP SDK
(PyPI mcp 2.x, `MCPServer`): it holds a token in $TOKEN (from a `{ secret = "..." }` reference)
and tells which one, never the token itself:

- `whoami`: `{"pid": <its pid>, "token_sha256": <SHA-256 hex of $TOKEN>, "arg": <its argv[1]>}`
  (argv[1]'s SHA-256 too when WHOAMI_HASH_ARG is set, for a secret given in `args`);
- `echo_token`: returns the token's literal value (an upstream that leaks its credential: the
  broker must redact it), in text and in structured content;
- `echo`: returns its `text` argument;
- `slow`: sleeps `seconds`, then answers.

At start it writes its token to stderr (the broker's log must show `[redacted: token]`).
A token starting `drift-` lists one more tool (`extra`): an instance whose listing differs.
"""

import hashlib
import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("whoami-token")
TOKEN = os.environ.get("TOKEN", "")


def sha(s):
    return hashlib.sha256(s.encode()).hexdigest()


@server.tool()
def whoami() -> dict:
    """Which token this process holds (its SHA-256), and its pid."""
    arg = sys.argv[1] if len(sys.argv) > 1 else ""
    return {"pid": os.getpid(), "token_sha256": sha(TOKEN), "arg_sha256": sha(arg)}


@server.tool()
def echo_token() -> dict:
    """Returns the token itself (a leaking upstream)."""
    return {"token": TOKEN, "said": "my token is " + TOKEN}


@server.tool()
def slow(seconds: float) -> str:
    """Sleeps, then answers (a call that outlives its time limit)."""
    time.sleep(seconds)
    return "slept"


@server.tool()
def echo(text: str) -> str:
    """Echoes its text."""
    return text


if TOKEN.startswith("drift-"):
    # A token whose account sees one more tool: this instance's listing differs from the pin.

    @server.tool()
    def extra() -> str:
        """Only some accounts have it."""
        return "extra"


if __name__ == "__main__":
    # A careless server that logs its credential: the broker's log must get the name only.
    if TOKEN:
        print("starting with token " + TOKEN, file=sys.stderr, flush=True)
    server.run("stdio")
