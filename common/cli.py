"""The command line of the four scripts: every flag comes from a field of `Config`, with the docstring
written under the field as its help. No torch here either, so the preflight stays fast."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import os
import textwrap
from dataclasses import fields
from typing import Sequence

from common.config import STRATEGIES, STRATEGY_FLAGS, Config
from common.errors import ConfigError


@functools.cache  # parsing the source costs ~30 ms, and a process may build several parsers
def _field_docs() -> dict[str, str]:
    """The docstring written under each field of Config, read from common/config.py's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(Config)))
    body = tree.body[0].body
    return {
        node.target.id: " ".join(str(nxt.value.value).split())
        for node, nxt in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
    }


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage block
        raise ConfigError(f"{message} (see --help)")


def build_parser(strategy: str) -> argparse.ArgumentParser:
    docs = _field_docs()
    parser = _Parser(
        prog=f"train_{strategy}.py",
        description=f"Train {'BabyGPT' if strategy in ('cp', 'ep') else 'BabyCNN, BabyViT or BabyGPT'} by "
        f"{strategy.upper()}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(Config):
        if not f.metadata.get("cli", True) or strategy not in STRATEGY_FLAGS.get(f.name, STRATEGIES):
            continue
        flag = "--" + f.name.replace("_", "-")
        # CP and EP exist for language models (EP for a mixture of experts: 8, Mixtral's count)
        default = {("cp", "model"): "gpt", ("ep", "model"): "gpt", ("ep", "experts"): 8}.get(
            (strategy, f.name), f.default
        )
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=docs[f.name])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, type=kind, default=default, help=docs[f.name], metavar=f.name.upper())
    return parser


def parse_config(strategy: str, argv: Sequence[str] | None = None, *, world_size: int | None = None) -> Config:
    """Flags -> validated Config. Raises ConfigError (one line) on any bad flag."""
    args = build_parser(strategy).parse_args(argv)
    cfg = Config(strategy=strategy, **vars(args))
    if not cfg.out:
        cfg.out = os.path.join("runs", strategy)
    return cfg.check(world_size=world_size)
