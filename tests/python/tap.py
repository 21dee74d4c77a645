"""A stdio tap: run a command, copy our stdin to it and its stdout to ours, and log every line
that goes to it (one JSON-RPC message per line) to the file named by TAP_LOG.

Used by the tests to see what the broker sends an upstream MCP server (e.g. notifications/cancelled).
Usage: python3 tap.py COMMAND [ARGS...]
"""
import os
import subprocess
import sys
import threading


def main():
    log = open(os.environ["TAP_LOG"], "a", buffering=1)
    child = subprocess.Popen(sys.argv[1:], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def downstream():
        for line in iter(child.stdout.readline, b""):
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()

    threading.Thread(target=downstream, daemon=True).start()
    for line in iter(sys.stdin.buffer.readline, b""):
        log.write(line.decode("utf-8", "replace"))
        child.stdin.write(line)
        child.stdin.flush()
    child.stdin.close()
    child.wait()


main()
