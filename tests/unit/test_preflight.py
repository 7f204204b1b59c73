"""The runners' preflight (runner/preflight.py, what `run_*.sh` runs before torchrun starts a worker) refuses more
CPU processes than the machine's memory holds: the memory wall's one line and exit 2, before any worker starts.
(tests/unit/test_memory_wall.py holds the wall's own arithmetic and advice.)"""

import pytest

import runner.memory
from runner.preflight import main


def test_the_preflight_refuses_more_cpu_processes_than_memory_holds(monkeypatch, capsys, tmp_path):
    # a 2 GiB machine: a BabyCNN process needs ~0.8 GB (the runtime and its planned peak), so 2 fit and 4 do not
    monkeypatch.setattr(runner.memory, "available_mib", lambda: 2 * 1024)
    flags = ["--device", "cpu", "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as refused:
        main(["ddp", "--world-size", "4", "--nproc", "4", *flags])
    assert refused.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: NPROC=4: 4 CPU processes need") and "at most 2 fit" in line
    main(["ddp", "--world-size", "2", "--nproc", "2", *flags])  # the number it names passes
    assert capsys.readouterr().err == ""
