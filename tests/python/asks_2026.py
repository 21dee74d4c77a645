"""An upstream MCP server (PyPI mcp 2.3.0 MCPServer) whose tools ask their client for input the
2026-07-28 way: the call's result is `input_required` (SEP-2322), carrying `elicitation/create`
requests, and the client sends the call again with `inputResponses` and the echoed
`requestState`. A client that negotiated 2025-11-25 is asked with `ctx.elicit` instead.
Each answer the server gets is a line in ASKS_LOG: `answer <tool> <round> <key> <action> <json content>`,
and each request it sees `call <tool> <protocol> <round>`.

Tools: `deploy` (two rounds: a confirm form, then a form naming the target; answers what it
got), `forever` (asks again every round), `sample` (asks for a model completion),
`state_only` (one round with a requestState and no question), `grow` (adds the tool `grown` and
announces it to `subscriptions/listen` streams).

Usage: python asks_2026.py [--http [--stateless] [--port N]]: stdio, or Streamable HTTP on
127.0.0.1 (`PORT <n>` on its first stdout line once it listens).
"""
import json
import os
import socket
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ElicitRequest, ElicitRequestFormParams, InputRequiredResult
from pydantic import BaseModel

app = MCPServer("asks-2026")


def log(line):
    path = os.environ.get("ASKS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def modern(ctx):
    return (ctx.protocol_version or "") >= "2026-07-28"


def form(message, props):
    return ElicitRequest(
        params=ElicitRequestFormParams(
            message=message,
            requested_schema={"type": "object", "properties": props, "required": list(props)},
        )
    )


def answers(ctx, tool, round_no):
    got = {}
    for key, value in (ctx.input_responses or {}).items():
        v = value if isinstance(value, dict) else value.model_dump(mode="json", by_alias=True, exclude_none=True)
        log(f"answer {tool} {round_no} {key} {v.get('action')} {json.dumps(v.get('content'), sort_keys=True)}")
        got[key] = v
    return got


class Confirm(BaseModel):
    confirm: bool


@app.tool()
async def deploy(service: str, ctx: Context) -> str | InputRequiredResult:
    """Deploys `service` after two questions."""
    state = ctx.request_state or "r0"
    log(f"call deploy {ctx.protocol_version} {state}")
    if not modern(ctx):
        r = await ctx.elicit(message=f"Deploy {service}?", schema=Confirm)
        return f"legacy answered: {r.action}"
    if state == "r0":
        return InputRequiredResult(
            input_requests={"confirm": form(f"Deploy {service}?", {"confirm": {"type": "boolean"}})},
            request_state="r1",
        )
    got = answers(ctx, "deploy", state)
    first = got.get("confirm", {})
    if state == "r1":
        if first.get("action") != "accept":
            return f"deploy stopped: {first.get('action')}"
        return InputRequiredResult(
            input_requests={"target": form("Which target?", {"target": {"type": "string", "enum": ["staging", "prod"]}})},
            request_state="r2",
        )
    second = got.get("target", {})
    if second.get("action") != "accept":
        return f"deploy stopped: {second.get('action')}"
    return f"deployed {service} to {second.get('content', {}).get('target')}"


@app.tool()
async def forever(ctx: Context) -> str | InputRequiredResult:
    """Asks again every round."""
    n = int((ctx.request_state or "0"))
    log(f"call forever {ctx.protocol_version} {n}")
    answers(ctx, "forever", n)
    return InputRequiredResult(
        input_requests={f"q{n}": form(f"Question {n}?", {"ok": {"type": "boolean"}})},
        request_state=str(n + 1),
    )


@app.tool()
async def sample(ctx: Context) -> str | InputRequiredResult:
    """Asks the client's model for a completion."""
    from mcp.types import CreateMessageRequest, CreateMessageRequestParams, SamplingMessage, TextContent

    log(f"call sample {ctx.protocol_version} {ctx.request_state}")
    if ctx.request_state:
        return "sampled"
    return InputRequiredResult(
        input_requests={
            "s": CreateMessageRequest(
                params=CreateMessageRequestParams(
                    messages=[SamplingMessage(role="user", content=TextContent(type="text", text="hi"))],
                    max_tokens=5,
                )
            )
        },
        request_state="s1",
    )


@app.tool()
async def state_only(ctx: Context) -> str | InputRequiredResult:
    """One round with a requestState and no question."""
    log(f"call state_only {ctx.protocol_version} {ctx.request_state}")
    if ctx.request_state == "again":
        return "state echoed"
    return InputRequiredResult(request_state="again")


@app.tool()
async def grow(ctx: Context) -> str:
    """Adds the tool `grown` and announces the change (on `subscriptions/listen` streams)."""

    def grown() -> str:
        """A tool added at run time."""
        return "grown"

    app.add_tool(grown, name="grown")
    await ctx.notify_tools_changed()
    log("grew")
    return "grew"


def main():
    args = sys.argv[1:]
    if "--http" not in args:
        app.run()
        return
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    port = int(args[args.index("--port") + 1]) if "--port" in args else 0
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    port = sock.getsockname()[1]
    http_app = app.streamable_http_app(stateless_http="--stateless" in args)
    config = uvicorn.Config(http_app, log_level="warning", timeout_graceful_shutdown=1)
    print(f"PORT {port}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
