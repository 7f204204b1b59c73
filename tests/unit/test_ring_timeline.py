"""tools/ring_timeline.py on a hand-written trace of a 2-rank ring (two attention layers, one step): it picks the
asked layer's blocks and transfers, draws them, and names a folder without traces or run.json in one line."""

import json

import pytest

from tools.ring_timeline import main, ring_spans

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


def op(name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": 1, "cat": cat}


def rank_events(shift):
    """A step of cp=2: per layer, a send and a receive started before the first block, then the second block;
    a step before it (outside the profiled step: ignored) and the backward's own sends after the forward."""
    events = [op("step 3", shift, 1000, "user_annotation"), op(FLASH, shift - 500, 10), op("gloo:send", shift - 400, 5)]
    for layer in range(2):
        t = shift + 10 + 200 * layer
        events += [op("gloo:send", t, 30, "user_annotation"), op("gloo:recv", t + 1, 40, "user_annotation")]
        events += [op(FLASH, t + 2, 20), op(FLASH, t + 45, 20), op(FLASH + "_backward", t + 600, 20)]
    events += [op("gloo:send", shift + 700, 30, "user_annotation")]
    return events


def test_the_asked_layers_ring_is_picked():
    ring = ring_spans(rank_events(100), cp=2, layer=1)
    assert ring == {"block": [(312, 332), (355, 375)], "send": [(310, 340)], "recv": [(311, 351)]}
    assert ring["send"][0][0] < ring["block"][0][0]  # the transfer started before the block beside it


def write_run(tmp_path, cp=2, ranks=2):
    (tmp_path / "traces").mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"mesh": {"dp": 1, "cp": cp}}))
    for rank in range(ranks):
        events = rank_events(100 + 7 * rank)
        (tmp_path / "traces" / f"rank{rank}.json").write_text(json.dumps({"traceEvents": events}))


def test_the_figure_is_drawn(tmp_path, capsys):
    write_run(tmp_path)
    out = tmp_path / "ring.png"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ring timeline:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "setup,args,message",
    [
        (lambda p: None, [], "no traces/rank*.json"),
        (lambda p: (p / "traces").mkdir() or (p / "traces" / "rank0.json").write_text("{}"), [], "no run.json"),
        (write_run, ["--layer", "2"], "layer 2: the trace has 4 aten::_scaled_dot"),
        (lambda p: write_run(p, cp=1, ranks=1), [], "a ring needs at least 2 ranks"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, setup, args, message):
    setup(tmp_path)
    with pytest.raises(SystemExit) as exit:
        main([str(tmp_path), *args])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
