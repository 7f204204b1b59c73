"""Plan, in order, the steps tests/integration/plans_ahead.py listed in FOLDER/wanted.pkl, each into FOLDER/<i>.pkl
(FOLDER/<i>.failed with the error, for the test to plan it again and see it), leaving those the tests' process has
claimed to it.

    python -m tests.integration.workers.plans FOLDER
"""

import os
import pickle
import sys
import traceback
from dataclasses import replace
from pathlib import Path

from tests.integration.plans_ahead import claim


def main(folder: Path) -> None:
    os.nice(19)  # the core time the shared launches and the other tests leave idle
    for i, planned in enumerate(pickle.loads((folder / "wanted.pkl").read_bytes())):
        if not claim(folder, i):
            continue
        try:
            memory = planned.plan()
        except Exception:
            (folder / f"{i}.failed").write_text(traceback.format_exc())
            continue
        if memory.count is not None:  # the operators' calls, kept to replay them (bench/machine.py), do not pickle
            memory.count.ops = {key: replace(op, call=None) for key, op in memory.count.ops.items()}
        (folder / f"{i}.tmp").write_bytes(pickle.dumps(memory))
        (folder / f"{i}.tmp").rename(folder / f"{i}.pkl")  # (whole, or not there)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
