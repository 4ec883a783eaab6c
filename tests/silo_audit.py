"""``lightning-fl`` with an audit of the files each process opens (issue 36's open-file
audit, run by tests/test_silos.py):

    python -m tests.silo_audit FOLDER OUT -- fit --config ... --trainer.devices 4

Every process (Lightning's launcher starts the others with the same command) records the
files it opens under FOLDER, through Python's audit hook on ``open``, and writes them to
``OUT/opened_rank<rank>.json`` when it exits (a named site's rank: its name's place).
"""

from __future__ import annotations

import json
import os
import sys

from lightning_fl.cli import run


def main() -> None:
    folder, out = os.path.realpath(sys.argv[1]), sys.argv[2]
    arguments = sys.argv[sys.argv.index("--") + 1 :]
    opened: set[str] = set()

    def audit(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(folder):
                opened.add(path)

    sys.addaudithook(audit)
    try:
        run(arguments, exit_on_error=False)
    finally:
        # a named site's rank is set from its name (RANK); Lightning's children have LOCAL_RANK
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        with open(os.path.join(out, f"opened_rank{rank}.json"), "w") as handle:
            json.dump(sorted(opened), handle)


if __name__ == "__main__":
    main()
