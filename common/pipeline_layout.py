"""Where a pipeline's stages live, in one object: how many ranks a pipeline has, how many stages, which rank
holds which stage, where BabyCNN is cut into them (common/model_sizes.py), and whether a layout can run at all.
The config's checks, train_pippy.py, evaluation and the reports all read it. No torch here, so the preflight
checks a layout before torchrun starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import ConfigError
from common.model_sizes import max_stages, stage_starts

if TYPE_CHECKING:
    from common.config import Config

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # exactly one stage per rank
V_SCHEDULES = ("zbv", "dualpipev")  # exactly two stages per rank, placed in a V
SPLIT_BACKWARD_SCHEDULES = ("interleaved-zb", "zbv", "dualpipev")  # input- and weight-gradient passes apart


@dataclass(frozen=True)
class PipelineLayout:
    schedule: str
    dp: int  # pipeline replicas, each its own slice of the global batch
    pp_size: int  # ranks of one pipeline
    stages_per_rank: int
    n_microbatches: int
    model_size: str = "baby"
    dataset: str = "digits"  # the input's shape moves the balanced cut of the larger sizes
    model: str = "cnn"
    tp: int = 1  # TP ranks splitting each stage (FSDP x PP x TP: world = dp x pp_size x tp)

    @classmethod
    def of(cls, cfg: Config, world_size: int) -> PipelineLayout:
        return cls(
            cfg.schedule,
            cfg.dp,
            world_size // (cfg.dp * cfg.tp),
            cfg.stages_per_rank,
            cfg.n_microbatches,
            cfg.model_size,
            cfg.dataset,
            cfg.model,
            cfg.tp,
        )

    @property
    def n_stages(self) -> int:
        return self.pp_size * self.stages_per_rank

    @property
    def stage_starts(self) -> tuple[str, ...]:
        """The first layer of each stage."""
        return stage_starts(self.model_size, self.n_stages, self.dataset, self.model)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` holds. Looped placement (the default): rank r holds r, r + p,
        r + 2p, ... The V schedules fold the pipeline back: rank r holds r and 2p - 1 - r, so the first AND
        the last stage live on rank 0."""
        if self.schedule in V_SCHEDULES:
            return [pp_rank, 2 * self.pp_size - 1 - pp_rank]
        return [pp_rank + k * self.pp_size for k in range(self.stages_per_rank)]

    def owner(self, stage: int) -> int:
        """The pipeline rank that holds `stage` (the inverse of stages_of)."""
        if self.schedule in V_SCHEDULES:
            return stage if stage < self.pp_size else 2 * self.pp_size - 1 - stage
        return stage % self.pp_size

    @property
    def local_handoff(self) -> bool:
        """Two consecutive stages on one rank (always in a V; any pipeline of one rank): the schedule hands the
        activation over in memory instead of sending it."""
        return any(self.owner(s) == self.owner(s + 1) for s in range(self.n_stages - 1))

    def __str__(self) -> str:  # the start-up line's
        world, tp = self.dp * self.pp_size * self.tp, f" x {self.tp} TP ranks" if self.tp > 1 else ""
        return f"{world} processes = {self.dp} replica(s) x {self.pp_size} pipeline ranks{tp}, {self.n_stages} stages"

    def describe(self) -> dict[str, object]:
        """run.json's view of the layout."""
        return {
            "pp_size": self.pp_size,
            "n_stages": self.n_stages,
            "stages_of_each_pipeline_rank": [self.stages_of(r) for r in range(self.pp_size)],
        }

    def check(self, *, chunk_size: int, compile: bool) -> None:
        """ConfigError unless this layout can train `chunk_size` samples per schedule step. These mirror what
        torch.distributed.pipelining (or BabyCNN) would reject later -- often only after the other ranks have
        started to wait for a message that never comes."""
        schedule, m, v, n_stages = self.schedule, self.n_microbatches, self.stages_per_rank, self.n_stages
        if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
            raise ConfigError(
                f"--stages-per-rank: {schedule} runs exactly 1 stage per rank, got {v}; "
                f"use interleaved-1f1b, looped-bfs or interleaved-zb for more"
            )
        if schedule in V_SCHEDULES and v != 2:
            raise ConfigError(
                f"--stages-per-rank: {schedule} places exactly 2 stages on each rank (in a V); pass --stages-per-rank 2"
            )
        if schedule not in SINGLE_STAGE_SCHEDULES + V_SCHEDULES and v < 2:
            raise ConfigError(
                f"--stages-per-rank: {schedule} is a schedule for 2 or more stages per rank, "
                f"got {v}; use gpipe or 1f1b for one"
            )
        if compile and schedule in SPLIT_BACKWARD_SCHEDULES:
            raise ConfigError(
                f"--compile: {schedule} splits each stage's backward into input- and weight-gradient passes, "
                f"which a compiled stage (one fused backward graph) cannot run; use 1f1b, gpipe, interleaved-1f1b "
                f"or looped-bfs, or drop --compile"
            )
        if n_stages > (most := max_stages(self.model_size, self.model)):
            raise ConfigError(
                f"--stages-per-rank: {self.pp_size} pipeline ranks x {v} stages per rank = {n_stages} stages, "
                f"but {self.model} {self.model_size} can be cut into at most {most}; use fewer "
                f"stages per rank, a larger --dp or fewer processes"
            )
        if chunk_size % m:
            raise ConfigError(
                f"--n-microbatches: {m} does not divide each replica's batch of {chunk_size} samples "
                f"(--batch-size / --dp / --grad-accum-steps); micro-batches must all have one size"
            )
        if schedule in ("1f1b", "dualpipev") and m < n_stages:
            stages = f"{n_stages} = 2 x {self.pp_size} ranks" if schedule == "dualpipev" else n_stages
            raise ConfigError(
                f"--n-microbatches: {schedule} needs at least as many micro-batches as stages ({stages}), got {m}"
            )
        rounds = max(1, m // self.pp_size)
        if schedule in ("interleaved-1f1b", "interleaved-zb") and m % rounds:
            raise ConfigError(
                f"--n-microbatches: {schedule} runs the micro-batches in rounds of about one per "
                f"rank ({self.pp_size}); {m} is not a multiple of its {rounds} rounds; use a multiple of "
                f"{self.pp_size}"
            )
