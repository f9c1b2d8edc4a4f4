"""pipeline.spark_settle on the tests' Spark session: the result, the job group cleared after,
a failure raised after settling too. (Its purpose, a beaten speculative attempt that has ended
before the commit, is checked on a two-host cluster in test_featurize_speculation.)"""

from __future__ import annotations

import pytest

from terascale.pipeline.spark_settle import active_attempts, collect_settled

pytestmark = pytest.mark.spark


def test_the_result_comes_back_and_the_job_group_is_cleared(spark):
    sc = spark.sparkContext
    rdd = sc.parallelize(range(40), 4).map(lambda x: x * x)
    assert collect_settled(sc, rdd, "terascale test: squares") == [x * x for x in range(40)]
    assert sc.getLocalProperty("spark.jobGroup.id") is None
    assert sc.getLocalProperty("spark.job.description") is None


def test_a_failed_job_raises_after_settling_and_clears_the_group(spark):
    sc = spark.sparkContext

    def boom(i, it):
        if i == 2:
            raise ValueError("bad partition")
        return it

    with pytest.raises(Exception, match="bad partition"):
        collect_settled(sc, sc.parallelize(range(8), 4).mapPartitionsWithIndex(boom), "terascale test: boom")
    assert sc.getLocalProperty("spark.jobGroup.id") is None


def test_active_attempts_of_an_unknown_group_is_zero(spark):
    assert active_attempts(spark.sparkContext, "terascale-no-such-group") == 0
