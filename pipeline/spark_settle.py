"""Collect a Spark job's results only once none of its task attempts is still running.

Spark returns a job's result as soon as every task has one successful attempt. The other
attempts of those tasks (the straggler a speculative copy beat, or the copy the straggler beat)
are killed asynchronously and may go on writing into their private attempt directories for a
while: on a loaded executor a losing attempt may still be parsing when the driver commits. A
job that deletes its staging area and renames its output right away would then carry a loser's
late files into the output, or leave them beside it. ``collect_settled`` runs the job in a job
group of its own and, once the result is in (or the job failed), waits until Spark's status
tracker shows no active task in any stage of that group's jobs: a killed attempt counts as
active until its executor reports it ended, and a Python worker that does not stop is destroyed
after ``spark.python.task.killTimeout``. It takes the context it is given and imports no
pyspark.
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
    """``rdd.collect()`` as a job described by ``description``; returns (or raises) only once
    every attempt of its tasks has ended, or after ``settle_timeout_s`` more (a warning then)."""
    group = f"terascale-{uuid.uuid4().hex[:12]}"
    sc.setJobGroup(group, description)
    try:
        return rdd.collect()
    finally:
        try:
            settle(sc, group, settle_timeout_s)
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)
            sc.setJobDescription(None)


def active_attempts(sc: Any, group: str) -> int:
    """Task attempts still running in the stages of the jobs of ``group``."""
    tracker = sc.statusTracker()
    active = 0
    for job_id in tracker.getJobIdsForGroup(group):
        job = tracker.getJobInfo(job_id)
        for stage_id in (job.stageIds if job is not None else ()):
            stage = tracker.getStageInfo(stage_id)
            if stage is not None:
                active += stage.numActiveTasks
    return active


def settle(sc: Any, group: str, timeout_s: float) -> bool:
    """Wait until no attempt of ``group``'s jobs runs; False (and a warning) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        active = active_attempts(sc, group)
        if active == 0:
            return True
        if time.monotonic() >= deadline:
            log.warning("%d task attempt(s) of a finished job still running after %.0f s; their "
                        "private directories may be left behind", active, timeout_s)
            return False
        time.sleep(_POLL_S)
