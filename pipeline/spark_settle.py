"""Collect a Spark job's results only once none of its task attempts is still running.

Spark returns a job's result as soon as every task has one successful attempt. The other
attempts of those tasks (the straggler a speculative copy beat, or the copy the straggler beat)
are killed asynchronously and may go on writing into their private attempt directories for a
while: on a loaded executor a losing attempt may still be parsing when the driver commits. A
job that deletes its staging area and renames its output right away would then carry a loser's
late files into the output, or leave them beside it. ``collect_settled`` runs the job in a job
group of its own and, once the result is in (or the job failed), waits until Spark's status
tracker shows the group's job ended and no active task in any of its stages: a killed attempt
counts as active until its executor reports it ended, and a Python worker that does not stop is
destroyed after ``spark.python.task.killTimeout``. The tracker is fed by Spark's listener bus,
which may lag behind ``collect()``, so a job not yet listed, or still listed as running, counts
as unsettled. After ``SETTLE_TIMEOUT_S`` (an executor that hangs) the caller goes on with a
warning. It takes the context it is given and imports no pyspark.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

log = logging.getLogger("terascale.spark")

SETTLE_TIMEOUT_S = 120.0
_POLL_S = 0.05


def collect_settled(sc: Any, rdd: Any, description: str, *, settle_timeout_s: float = SETTLE_TIMEOUT_S) -> list:
    """``rdd.collect()`` as a job described by ``description``; returns (or raises the job's
    error) only once every attempt of its tasks has ended, or ``settle_timeout_s`` later."""
    group = f"terascale-{uuid.uuid4().hex[:12]}"
    expect_job = rdd.getNumPartitions() > 0
    sc.setJobGroup(group, description)
    try:
        return rdd.collect()
    finally:
        try:
            settle(sc, group, settle_timeout_s, expect_job=expect_job)
        except Exception as exc:  # noqa: BLE001 - never replaces the job's own result or error
            log.warning("could not check that the job's task attempts have ended: %s", exc)
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)
            sc.setJobDescription(None)


def unsettled(sc: Any, group: str, *, expect_job: bool = True) -> int:
    """How many things of ``group`` are not over: its task attempts still running, plus one per
    job still running, plus one if ``expect_job`` and no job of the group is listed yet."""
    tracker = sc.statusTracker()
    job_ids = list(tracker.getJobIdsForGroup(group))
    count = 1 if expect_job and not job_ids else 0
    for job_id in job_ids:
        job = tracker.getJobInfo(job_id)
        if job is None:
            continue
        if job.status == "RUNNING":
            count += 1
        for stage_id in job.stageIds:
            stage = tracker.getStageInfo(stage_id)
            if stage is not None:
                count += stage.numActiveTasks
    return count


def settle(sc: Any, group: str, timeout_s: float, *, expect_job: bool = True) -> bool:
    """Wait until nothing of ``group`` runs (:func:`unsettled`); False, with a warning, after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = unsettled(sc, group, expect_job=expect_job)
        if left == 0:
            return True
        if time.monotonic() >= deadline:
            log.warning("a finished job still has %d task attempt(s) or job(s) running after %.0f s; "
                        "their private directories may be left behind", left, timeout_s)
            return False
        time.sleep(_POLL_S)
