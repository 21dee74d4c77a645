"""A harness that answers MCP elicitation: the Python MCP SDK client (PyPI mcp 2.3.0) driving
sharedos-mcp-shim, with a real `elicitation_callback` standing in for the person.

Env: SHAREDOS_SHIM, SHAREDOS_TURN_TOKEN, SHAREDOS_BROKER (for the shim); ELICIT_ANSWER: what the
person does, `approve`, `deny` (accept with decision deny), `decline`, `cancel`, `slow` (answers
approve after ELICIT_SLOW_SECONDS), or `none` (no callback: the client declares no elicitation
capability); ELICIT_MODE: `legacy` (initialize, 2025-11-25) or `auto` (2026-07-28, where the shim
asks with `input_required` results the client retries); ELICIT_CALLS: a JSON list of
[tool, arguments]; ELICIT_URL_FILE: where the link of a URL-mode question is written (the
person's page, issue 45). Prints a JSON report as the last line: each call's [isError, text, code],
every question the person was shown (message and schema), and the `elicitationId` of every
`notifications/elicitation/complete` the client received (`completed`, in order; seen by the
ClientSession's message handler).

ELICIT_ROUNDS (mode `auto` only), instead of ELICIT_CALLS: drives input_required rounds by hand, as
a client that keeps or replays `requestState` would. A JSON list of steps
{"call": [tool, args], "state": NAME or null, "answer": "approve" | "deny" | null, "save": NAME};
each sends the call (with the saved round's `requestState` and an answer to its question when
given) and reports {"kind": "input_required" | "result", "isError", "code", "keys"}.
"""
import json
import os
import sys

import anyio
from mcp import Client, MCPError, StdioServerParameters
from mcp.types import ElicitResult

questions = []
completed = []


async def notes(message):
    """The client's message handler: server notifications (and transport errors) come here."""
    if getattr(message, "method", None) == "notifications/elicitation/complete":
        completed.append(message.params.elicitation_id)


def filled(schema):
    """What the person types into a form that is not the approval's: true for a boolean, the
    first option or "x" for a string."""
    content = {}
    for key, prop in (schema or {}).get("properties", {}).items():
        if prop.get("type") == "boolean":
            content[key] = True
        elif prop.get("type") == "string":
            content[key] = (prop.get("enum") or ["x"])[0]
    return content


async def person(ctx, params):
    answer = os.environ.get("ELICIT_ANSWER", "approve")
    dump = params.model_dump(mode="json", by_alias=True, exclude_none=True)
    questions.append(dump)
    if answer == "slow" and "decision" not in dump.get("requestedSchema", {}).get("properties", {}):
        # A brokered server's question, answered late too.
        await anyio.sleep(float(os.environ.get("ELICIT_SLOW_SECONDS", "5")))
    if dump.get("mode") == "url":
        # The link goes to the person (ELICIT_URL_FILE: where the test's browser picks it up).
        if os.environ.get("ELICIT_URL_FILE"):
            with open(os.environ["ELICIT_URL_FILE"] + ".tmp", "w") as f:
                f.write(dump.get("url", ""))
            os.replace(os.environ["ELICIT_URL_FILE"] + ".tmp", os.environ["ELICIT_URL_FILE"])
        return ElicitResult(action="accept" if answer in ("approve", "slow") else answer)
    if "decision" not in dump.get("requestedSchema", {}).get("properties", {}):
        # A brokered server's own question.
        if answer in ("approve", "slow"):
            return ElicitResult(action="accept", content=filled(dump.get("requestedSchema")))
        return ElicitResult(action=answer if answer in ("decline", "cancel") else "decline")
    if answer == "slow":
        await anyio.sleep(float(os.environ.get("ELICIT_SLOW_SECONDS", "5")))
        return ElicitResult(action="accept", content={"decision": "approve"})
    if answer == "approve":
        return ElicitResult(action="accept", content={"decision": "approve"})
    if answer == "deny":
        return ElicitResult(action="accept", content={"decision": "deny"})
    return ElicitResult(action=answer)


def answer_of(word):
    content = {"decision": word}
    return ElicitResult(action="accept", content=content).model_dump(mode="json", by_alias=True, exclude_none=True)


async def by_hand(client, steps):
    saved = {}
    out = []
    for step in steps:
        tool, args = step["call"]
        kwargs = {"allow_input_required": True}
        if step.get("state"):
            state, keys = saved[step["state"]]
            kwargs["request_state"] = state
            if step.get("answer"):
                kwargs["input_responses"] = {k: answer_of(step["answer"]) for k in keys}
        result = await client.session.call_tool(tool, args, **kwargs)
        if getattr(result, "result_type", None) == "input_required":
            keys = sorted((result.input_requests or {}).keys())
            if step.get("save"):
                saved[step["save"]] = (result.request_state, keys)
            out.append({"kind": "input_required", "keys": keys})
        else:
            meta = (result.meta or {}).get("sharedos") or {}
            out.append({"kind": "result", "isError": bool(result.is_error), "code": meta.get("code")})
    return out


async def main():
    params = StdioServerParameters(command=os.environ["SHAREDOS_SHIM"], args=[], env=dict(os.environ))
    mode = os.environ.get("ELICIT_MODE", "legacy")
    calls = json.loads(os.environ.get("ELICIT_CALLS", "[]"))
    callback = None if os.environ.get("ELICIT_ANSWER") == "none" else person
    report = {"calls": []}
    rounds = json.loads(os.environ.get("ELICIT_ROUNDS", "null"))
    async with Client(params, mode=mode, read_timeout_seconds=float(os.environ.get("ELICIT_READ_TIMEOUT", "60")), elicitation_callback=callback, message_handler=notes) as client:
        report["protocol"] = str(client.protocol_version)
        if rounds is not None:
            report["rounds"] = await by_hand(client, rounds)
        for tool, args in calls:
            result = await client.call_tool(tool, args)
            text = result.content[0].text if result.content else ""
            meta = (result.meta or {}).get("sharedos") or {}
            report["calls"].append([bool(result.is_error), text, meta.get("code")])
    report["questions"] = questions
    report["completed"] = completed
    print(json.dumps(report))


try:
    anyio.run(main)
except MCPError as e:
    print(f"JSON-RPC error {e.code}: {e}", file=sys.stderr)
    sys.exit(1)
