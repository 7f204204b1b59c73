"""tools/routing.py on a metrics.jsonl it is given (2 layers of 4 experts, 3 steps, a resumed step written twice): the
table's imbalance and dropped numbers, the figure written, and a folder without routing named in one line."""

import json

import pytest

from tools.routing import load_run, main

# [step][layer][expert]: layer 0 even then collapsing onto expert 2, layer 1 leaning on expert 0 throughout
TOKENS = [
    [[100, 100, 100, 100], [160, 80, 80, 80]],
    [[50, 50, 250, 50], [200, 100, 50, 50]],
    [[0, 0, 400, 0], [130, 90, 90, 90]],
]
DROPPED = [[0, 4], [0, 6], [0, 10]]


def write_run(path, tokens=TOKENS, dropped=DROPPED, config=True):
    records = [{"kind": "eval", "step": 0, "test_loss": 5.0}]
    records += [
        {"kind": "train", "step": s + 1, "loss": 4.0, "tokens_per_expert": t, "dropped": d}
        for s, (t, d) in enumerate(zip(tokens, dropped))
    ]
    # a resume wrote step 3 again, with other counts before: the last record of a step is the one read
    records.insert(3, {"kind": "train", "step": 3, "loss": 4.0, "tokens_per_expert": TOKENS[0], "dropped": [9, 9]})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config:
        (path / "run.json").write_text(json.dumps({"config": {"experts": 4, "top_k": 2, "aux_loss_coef": 0.01}}))


def test_the_routing_is_read_per_step(tmp_path):
    write_run(tmp_path)
    run = load_run(str(tmp_path))
    assert run.steps == [1, 2, 3] and run.tokens == TOKENS and run.dropped == DROPPED
    assert (run.layers, run.experts) == (2, 4)
    assert run.shares(0)[2] == [0.25, 250 / 400, 1.0]
    assert run.imbalance(0, 0) == (1.0, 0) and run.imbalance(-1, 0) == (4.0, 2)  # 400 of 400 on one of 4 experts


def test_the_table_and_the_figure(tmp_path, capsys):
    write_run(tmp_path)
    out = tmp_path / "routing.png"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "run | layer | max/even, first step | max/even, largest | max/even, last step | dropped"
    # layer 0: even at step 1, every assignment on expert 2 at step 3; layer 1: 160 of 400 x 4, 130 of 400 x 4
    # (layer 1's largest: 200 of 400 x 4 at step 2)
    first, largest, last = "1.00 (expert 0, step 1)", "4.00 (expert 2, step 3)", "4.00 (expert 2, step 3)"
    assert lines[1] == f"{tmp_path} | 0 | {first} | {largest} | {last} | 0 of 1200 (0.0%)"
    first, largest, last = "1.60 (expert 0, step 1)", "2.00 (expert 0, step 2)", "1.30 (expert 0, step 3)"
    assert lines[2] == f"{tmp_path} | 1 | {first} | {largest} | {last} | 20 of 1200 (1.7%)"
    assert lines[3] == f"routing: {out}"


def test_several_runs_one_figure(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write_run(a)
    write_run(b, tokens=[[row[::-1] for row in step] for step in TOKENS], config=False)  # no run.json: still drawn
    assert main([str(a), str(b)]) == 0
    assert (a / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # by default beside the first run
    out = capsys.readouterr().out
    assert f"{b} | 0 | 1.00 (expert 0, step 1) | 4.00 (expert 1, step 3) | 4.00 (expert 1, step 3)" in out


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda p: None, "metrics.jsonl: No such file or directory"),
        (lambda p: (p / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n'), "no train record has tokens"),
        (lambda p: (p / "metrics.jsonl").write_text("{not json\n"), "not JSON lines"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, setup, message):
    setup(tmp_path)
    with pytest.raises(SystemExit) as exit:
        main([str(tmp_path)])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
