"""The traffic arithmetic (planner/predict.py) and the count of collectives from a trace (common/profiling.py)."""

import pytest

from common.profiling import traffic_counted
from planner.predict import add, padded_shard, total_bytes


def test_ring_shares_are_nccl_tests_bus_factors():
    traffic = add({}, "all_reduce", elements=1000, itemsize=4, ranks=4)
    assert traffic["all_reduce"] == {"elements": 1000, "bytes": 4000, "bytes_sent": 6000, "bytes_received": 6000}
    add(traffic, "all_gather", elements=1000, itemsize=2, ranks=4, times=2)  # the gathered size, twice
    assert traffic["all_gather"]["bytes_sent"] == pytest.approx(2 * 2000 * 3 / 4)
    add(traffic, "send", elements=10, itemsize=4, times=3)
    add(traffic, "recv", elements=10, itemsize=4, times=3)
    assert (traffic["send"]["bytes_sent"], traffic["recv"]["bytes_received"], traffic["recv"]["bytes_sent"]) == (
        120,
        120,
        0,
    )
    assert total_bytes(traffic) == 6000 + 3000 + 120
    assert add({}, "all_reduce", elements=8, itemsize=4, ranks=1) == {}  # alone: nothing runs, nothing moves


def test_fsdp_pads_dim_0_to_equal_shards():
    assert padded_shard((10, 3), 4) == 3 * 3  # rows 3, 3, 3, 1 (+2 of padding)
    assert padded_shard((8,), 4) == 2
    assert padded_shard((1, 5), 4) == 5


def test_collectives_are_counted_per_step_from_the_trace_without_single_numbers():
    def op(name, dims):
        return {"ph": "X", "name": name, "args": {"Input Dims": dims}}

    events = [
        op("c10d::allreduce_", [[[1000], [24]], [], []]),  # a bucket of two tensors
        op("c10d::allreduce_", [[[]], [], []]),  # the loss: left out
        op("c10d::_allgather_base_", [[400], [100], []]),  # counted by the gathered output
        op("c10d::_reduce_scatter_base_", [[100], [400], []]),  # counted by the input
        op("c10d::send", [[[8, 64]], []]),
        op("gloo:all_reduce", []),  # the backend's own span of the same call: not counted twice
    ]
    counted = traffic_counted(events * 2, steps=2)
    assert counted == {
        "all_reduce": {"calls": 1, "elements": 1024},
        "all_gather": {"calls": 1, "elements": 400},
        "reduce_scatter": {"calls": 1, "elements": 400},
        "send": {"calls": 1, "elements": 512},
    }
