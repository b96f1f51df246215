"""A Dask worker preload: a job's second worker process starts late, as after a slow
import or a GPU warm-up (tests/test_batch_jobs.py)."""

import os
import time


def dask_setup(worker):
    if str(worker.name).endswith("-1"):
        time.sleep(float(os.environ.get("CEREBRO_TEST_LATE", "8")))
