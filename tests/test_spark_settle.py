"""pipeline.spark_settle on the tests' Spark session: it sees a running attempt, the result
comes back and the job group is cleared, a failure is raised after settling too. (Its purpose, a
beaten speculative attempt that has ended before the commit, is checked on a two-host cluster in
test_featurize_speculation.)"""

from __future__ import annotations

import threading
import time

import pytest

from terascale.pipeline.spark_settle import collect_settled, settle, unsettled

pytestmark = pytest.mark.spark


def _wait(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_running_attempt_is_unsettled_until_it_ends(spark, tmp_path):
    sc = spark.sparkContext
    started, release = tmp_path / "started", tmp_path / "release"

    def hold(i, it):  # partition 0 waits for the test's go-ahead; it never waits forever
        if i == 0:
            started.touch()
            deadline = time.monotonic() + 120
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        return it

    group = "terascale-test-settle"
    out: list = []

    def job() -> None:
        sc.setJobGroup(group, "terascale test: held")
        out.extend(sc.parallelize(range(4), 2).mapPartitionsWithIndex(hold).collect())

    t = threading.Thread(target=job)
    t.start()
    try:
        _wait(started.exists)
        _wait(lambda: unsettled(sc, group) >= 2)  # the job and partition 0's attempt are running
        assert not settle(sc, group, 0.2)  # gives up after its timeout while the attempt runs
    finally:
        release.touch()
        t.join(120)
    assert out == [0, 1, 2, 3]
    assert settle(sc, group, 60.0) and unsettled(sc, group) == 0


def test_the_result_comes_back_and_the_job_group_is_cleared(spark):
    sc = spark.sparkContext
    rdd = sc.parallelize(range(40), 4).map(lambda x: x * x)
    assert collect_settled(sc, rdd, "terascale test: squares") == [x * x for x in range(40)]
    assert sc.getLocalProperty("spark.jobGroup.id") is None
    assert sc.getLocalProperty("spark.job.description") is None


def test_a_failed_job_raises_its_own_error_and_clears_the_group(spark):
    sc = spark.sparkContext

    def boom(i, it):
        if i == 2:
            raise ValueError("bad partition")
        return it

    with pytest.raises(Exception, match="bad partition"):
        collect_settled(sc, sc.parallelize(range(8), 4).mapPartitionsWithIndex(boom), "terascale test: boom")
    assert sc.getLocalProperty("spark.jobGroup.id") is None
