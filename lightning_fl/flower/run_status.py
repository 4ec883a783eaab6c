"""A Flower run's outcome as an exit status (README, "Deploying across hospitals"):

    python -m lightning_fl.flower.run_status RUN_ID [SUPERLINK] [--wait SECONDS]

``flwr run`` returns 0 whether or not the run succeeds, and Flower gives a ServerApp no
way to set it, so this asks the SuperLink (``flwr ls --run-id RUN_ID --format json``):
it prints the run's status and exits 0 when the run completed, 1 with one last line
giving the server's reason when it failed or was stopped (the ServerApp's error from
``flwr log RUN_ID --show``: the site at fault, or the site that dropped), and 2 when it
has not finished (after waiting up to ``--wait`` seconds for it to).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence

#: what the relay's error says in the server's log (lightning_fl.flower.apps.SiteFailure)
FAILURE_MARK = "SiteFailure: "


def _flwr(*args: str) -> subprocess.CompletedProcess:
    beside = os.path.join(os.path.dirname(sys.executable), "flwr")
    executable = beside if os.access(beside, os.X_OK) else "flwr"
    return subprocess.run([executable, *args], capture_output=True, text=True, timeout=120)


def status(run_id: int, superlink: Sequence[str]) -> tuple[str, str]:
    """The run's status (``finished:completed``, ``finished:failed``, ``running``, ...)
    and Flower's details of it."""
    listed = _flwr("ls", *superlink, "--run-id", str(run_id), "--format", "json")
    try:
        runs = json.loads(listed.stdout)["runs"]
    except (ValueError, KeyError):
        raise SystemExit(
            f"lightning-fl: flwr ls could not list run {run_id}: {_last_line(listed)}"
        ) from None
    return runs[0]["status"], runs[0].get("status-details") or ""


#: a traceback's last line: the exception's (dotted) class name, then its message
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failure): ")


def reason(run_id: int, superlink: Sequence[str], details: str) -> str:
    """Why the run failed: the last error of the relay in the server's log, else the
    ServerApp's last exception there (``<module>.<Name>Error: …``), else its last error
    line, else Flower's details."""
    lines = _flwr("log", str(run_id), *superlink, "--show").stdout.splitlines()
    marked = [line.split(FAILURE_MARK, 1)[1] for line in lines if FAILURE_MARK in line]
    if marked:
        return marked[-1].strip()
    raised = [line.strip() for line in lines if EXCEPTION_LINE.match(line.strip())]
    if raised:
        return raised[-1]
    errors = [line.strip() for line in lines if "Error" in line or "ERROR" in line]
    return errors[-1] if errors else details or "no reason in the server's log"


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_fl.flower.run_status", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_id", type=int)
    parser.add_argument("superlink", nargs="?", help="the SuperLink connection's name")
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the end")
    options = parser.parse_args(args)
    superlink = [options.superlink] if options.superlink else []
    deadline = time.monotonic() + options.wait
    state, details = status(options.run_id, superlink)
    while not state.startswith("finished") and time.monotonic() < deadline:
        time.sleep(2.0)
        state, details = status(options.run_id, superlink)
    print(f"run {options.run_id}: {state}", flush=True)
    if state == "finished:completed":
        return 0
    if not state.startswith("finished"):
        print(f"lightning-fl: run {options.run_id} has not finished: wait with --wait SECONDS.",
              file=sys.stderr)  # fmt: skip
        return 2
    why = reason(options.run_id, superlink, details)
    print(f"lightning-fl: run {options.run_id} {state.split(':')[-1]}: {why}", file=sys.stderr)
    return 1


def _last_line(result: subprocess.CompletedProcess) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {result.returncode}"


if __name__ == "__main__":
    sys.exit(main())
