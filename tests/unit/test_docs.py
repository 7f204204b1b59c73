"""The pages stay true: README.md and every topic page docs/*.md (found by glob), checked against today's code.

* every command a page shows (`python -m ...`, `python <script>.py ...`, `torchrun ...`, `bash run_*.sh ...`, in
  fenced blocks and inline code) parses with the entry point's own parser, stopping before anything runs, touches a
  file or needs hardware (tests/doc_commands.py says where each stops, and which placeholders it reads how);
* every backticked `module.symbol` imports and has the attribute, a bare `snake_case_name` is defined or used by
  the code, every backticked or linked path exists, every link and `#anchor` resolves (tests/doc_refs.py).

Not docs/benchmarks/: a dated report keeps its commands as they ran that day. One page: `pytest
tests/unit/test_docs.py -k tp.md`; `-s` prints each page's count of commands checked and those skipped. A failure
names the page, the line, the command and the error today's parser gives."""

from __future__ import annotations

import functools
import re

import pytest

from tests.doc_commands import Outcome, check_page, summary
from tests.doc_markdown import ROOT, read_page, slug
from tests.doc_markdown import pages as find_pages
from tests.doc_refs import check_page_refs, check_path, check_symbol

PAGES = find_pages()
# Today's pages hold ~170 commands parsed (2026-12-03); fewer than this would mean the finder matched little
MIN_COMMANDS = 100


@functools.cache
def outcomes(page: str) -> tuple[Outcome, ...]:
    return tuple(check_page(page))


def _mentions_commands(page: str) -> bool:
    """Whether the page's code shows a command of the kinds checked (so that checking none would be a miss)."""
    found = read_page(page)
    code = [s.text for s in found.spans] + [line for f in found.fences for line in f.lines]
    return any(re.search(r"(^|\s)(python3? |torchrun |bash run_)", text) for text in code)


@pytest.mark.parametrize("page", PAGES, ids=PAGES)
def test_commands_parse(page: str) -> None:
    checked = outcomes(page)
    print(f"{page}: {summary(list(checked))}")
    for o in checked:
        if o.status == "skipped":
            print(f"  skipped {o.line()}")
    if _mentions_commands(page):
        assert any(o.status in ("ok", "failed", "name") for o in checked), f"{page}: shows commands, none checked"
    failed = [o.line() for o in checked if o.status == "failed"]
    if failed:
        pytest.fail(f"{page}: {summary(list(checked))}\n" + "\n".join(failed), pytrace=False)


@pytest.mark.parametrize("page", PAGES, ids=PAGES)
def test_names_paths_and_links_resolve(page: str) -> None:
    problems = [f"{page}:{line}: {problem}" for line, problem in check_page_refs(read_page(page))]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_the_pages_hold_enough_commands_to_check() -> None:
    counts = {page: sum(o.status in ("ok", "failed") for o in outcomes(page)) for page in PAGES}
    assert "README.md" in counts and any(p.startswith("docs/") for p in counts)
    assert sum(counts.values()) >= MIN_COMMANDS, counts


# ---------------------------------------------------------------- the checks themselves, on pages written here
def _one(text: str) -> list[Outcome]:
    return check_page("docs/example.md", text)


def test_a_stale_command_fails_with_the_page_line_and_todays_error() -> None:
    (stale,) = _one("intro\n\n```bash\npython -m bench --micro-only --compile   # the old way\n```\n")
    assert stale.status == "failed"
    assert stale.line().startswith("docs/example.md:4: `python -m bench --micro-only --compile`: ")
    assert "error: unrecognized arguments: --micro-only --compile" in stale.message  # (argparse's words)
    (fixed,) = _one("intro\n\n```bash\npython -m bench --quick   # the benchmark, tiny\n```\n")
    assert fixed.status == "ok", fixed.line()


def test_a_module_that_is_gone_fails_and_its_successor_passes() -> None:
    gone, there = _one("`python -m bench.soak --runs 40` became `python -m tests.soak --runs 40`.\n")
    assert (gone.status, gone.message) == ("failed", "no module bench.soak in this repository")
    assert there.status == "ok", there.line()


def test_training_flags_are_checked_by_config_not_only_by_argparse() -> None:
    bad, good = _one(
        "`python train_ddp.py --loss-scale 1024` and `python train_ddp.py --precision fp16 --loss-scale 1024`"
    )
    assert bad.status == "failed" and bad.message.startswith("error: --loss-scale:"), bad.line()
    assert good.status == "ok", good.line()


def test_runners_env_prefixes_continuations_comments_and_documented_errors() -> None:
    text = (
        "```bash\nNPROC=2 time bash run_ddp.sh \\\n    --epochs 3   # any flag\nbash run_ddp.sh --epocs 3\n```\n\n"
        "```\n$ NPROC=3 bash run_ddp.sh\nerror: --batch-size: the global batch 128 (/ --grad-accum-steps 1) does "
        "not split evenly over 3 processes; use a multiple of 3\n$ NPROC=3 bash run_tp.sh\nerror: --tp: ... wrong\n"
        "$ NNODES=x bash run_ddp.sh\nerror: NNODES=x must be ...\n```\n"
    )
    prefixed, typo, documented, misdocumented, env_error = _one(text)
    assert (prefixed.status, prefixed.command.line) == ("ok", 2), prefixed.line()
    assert typo.status == "failed" and "--epocs" in typo.message, typo.line()
    assert documented.status == "ok", documented.line()
    assert misdocumented.status == "failed" and misdocumented.message.startswith("documented `error: --tp: ..."), (
        misdocumented.line()
    )
    assert env_error.status == "ok", env_error.line()  # launch.sh's own check, matched with `...`


def test_placeholders_alternatives_variables_and_loops() -> None:
    text = (
        '```bash\nF="--dropout 0 --max-steps 30"\npython train_ddp.py $F --out runs/one\n'
        "for m in 4 8; do bash run_pippy.sh --n-microbatches $m; done\n```\n\n"
        "`bash run_<ddp|fsdp>.sh --max-steps 12 [--threads 1]`, `bash run_fsdp.sh --sharding MODE`, "
        "`bash run_all.sh [flags]`, `python -m tools.compare RUN... --out FILE.png`, `torchrun ...`\n"
    )
    shown = {o.shown: o.status for o in _one(text)}
    assert shown == {
        "python train_ddp.py --dropout 0 --max-steps 30 --out runs/one": "ok",
        "bash run_pippy.sh --n-microbatches 4": "ok",
        "bash run_pippy.sh --n-microbatches 8": "ok",
        "bash run_ddp.sh --max-steps 12 --threads 1": "ok",
        "bash run_fsdp.sh --max-steps 12 --threads 1": "ok",
        "bash run_fsdp.sh --sharding MODE": "skipped",
        "bash run_all.sh": "name",
        "python -m tools.compare RUN --out FILE.png": "ok",
        "torchrun": "skipped",
    }


def test_suggested_commands_and_bash_c() -> None:
    text = (
        "```\n$ bash run_ddp.sh --checkpoint-every 10\ninterrupted (SIGINT) at step 13; continue with: bash run_ddp.sh "
        "--checkpoint-every 10 --resumed\n```\n\n"
        "`bash -c 'ulimit -d 1500000; NPROC=2 bash run_ddp.sh --model-size medium'`\n"
    )
    run, suggested, inner = _one(text)
    assert run.status == "ok" and inner.status == "ok", (run.line(), inner.line())
    assert (suggested.status, suggested.command.line) == ("failed", 3) and "--resumed" in suggested.message


def test_torchrun_is_parsed_by_torchruns_parser_then_the_script_by_its_own() -> None:
    text = "```bash\ntorchrun --standalone --nproc-per-node 4 train_ddp.py --max-steps 3\n"
    text += "torchrun --nproc-per-node 4 train_ddp.py --max-stepz 3\ntorchrun --nprocs 4 train_ddp.py\n"
    text += "torchrun --nproc-per-node 3 train_ddp.py\n```\n"
    ok, script_flag, torchrun_flag, world_size = _one(text)
    assert ok.status == "ok", ok.line()
    assert script_flag.status == "failed" and "--max-stepz" in script_flag.message
    assert torchrun_flag.status == "failed" and torchrun_flag.message.startswith("torchrun:")
    assert world_size.status == "failed" and "over 3 processes" in world_size.message, world_size.line()


def test_checking_a_command_writes_nothing(tmp_path) -> None:
    """The preflight stops before --out is prepared (a previous run set aside) or a data set fetched."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    (checked,) = _one(f"`bash run_ddp.sh --out {out} --resume --dataset mnist --data-dir {tmp_path / 'data'}`")
    assert checked.status == "ok", checked.line()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl"]


def test_symbols_and_paths() -> None:
    assert check_symbol("common.clipping.clip_grad_norm") is None
    assert check_symbol("planner.timing.predict_time_s()") is None
    assert check_symbol("Checkpoints.start") is None
    assert check_symbol("common.checkpoint.load_checkpoint") == "common.checkpoint has no load_checkpoint"
    assert check_symbol("save_checkpoint") == "save_checkpoint: nothing in the code defines or uses this name"
    assert check_symbol("clip_grad_norm") is None and check_symbol("grad_norm") is None  # a key run.json holds
    assert check_symbol("torch.compile") is None and check_symbol("run.json") is None  # not the suite's names
    assert check_path("common/checkpoint.py") is None and check_path("docs/benchmarks/") is None
    assert check_path("common/nope.py") == "no common/nope.py in the repository"
    assert check_path("runs/ddp/run.json") is None and check_path("model.pt") is None  # outputs
    assert check_path("train_ddp.py:42") is None and check_path("nope.py") == "no file nope.py in the repository"


def test_links_and_githubs_anchors() -> None:
    assert slug("FSDP × TP: a 2-D mesh") == "fsdp--tp-a-2-d-mesh"
    assert slug("`torch.compile`") == "torchcompile"
    assert slug("FSDP's bytes against DDP's") == "fsdps-bytes-against-ddps"
    page = read_page(
        "docs/example.md",
        "# Top\n\n## Same\n\n## Same\n\n[a](#same-1) [b](#nope) [c](tp.md) [d](../README.md#tests) [e](gone.md)\n"
        "`[f](#not-a-link)` [g](https://example.com#x)\n",
    )
    from tests.doc_refs import check_links

    assert check_links(page) == [
        (7, "link #nope: no heading with the anchor #nope in docs/example.md"),
        (7, "link gone.md: no docs/gone.md"),
    ]
    assert (ROOT / "docs" / "tp.md").exists()  # (the link [c] above resolves to a real page)


def test_imports_in_python_blocks() -> None:
    from tests.doc_refs import check_imports

    text = "```python\nfrom train_ddp import apply_ddp\nfrom common.checkpoint import load_checkpoint\n"
    text += "import torch\n```\n"
    assert check_imports(read_page("docs/example.md", text)) == [
        (3, "import common.checkpoint.load_checkpoint: common.checkpoint has no load_checkpoint")
    ]
