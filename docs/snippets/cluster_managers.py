import importlib.util

from distributed import LocalCluster

from tiny import data, spec


# --8<-- [start:search_on]
from distributed import Client
from cerebro_automl.adapters.search import grid_search

# give the data an explicit num_partitions here: by default it is the number of workers at start
def search_on(cluster, workers: int):
    cluster.scale(workers)                          # or cluster.adapt(minimum=..., maximum=...)
    with Client(cluster) as client:
        return grid_search(spec, data, {"lr": [1e-3, 3e-3], "width": [32]}, epochs=1, client=client,
                           min_workers=workers)     # wait for the workers the cluster is starting
# --8<-- [end:search_on]


def slurm():
    # --8<-- [start:slurm]
    from dask_jobqueue import SLURMCluster
    cluster = SLURMCluster(cores=1, processes=1, memory="8GB", walltime="02:00:00",
                           worker_extra_args=["--nthreads", "1"])
    search_on(cluster, workers=8)
    # --8<-- [end:slurm]


def slurm_gpus():
    # --8<-- [start:slurm_gpus]
    from dask_jobqueue import SLURMCluster
    # One job per 4-GPU node: 4 worker processes that all see the node's GPUs; each takes its own.
    cluster = SLURMCluster(cores=4, processes=4, job_cpu=16, memory="200GB", walltime="08:00:00",
                           job_extra_directives=["--gres=gpu:4"],
                           worker_extra_args=["--nthreads", "1"])
    search_on(cluster, workers=8)                   # two nodes
    # --8<-- [end:slurm_gpus]


def dask_cuda():
    # --8<-- [start:dask_cuda]
    from dask_cuda import LocalCUDACluster
    cluster = LocalCUDACluster(threads_per_worker=1)  # one worker per GPU of this machine
    search_on(cluster, workers=len(cluster.workers))
    # --8<-- [end:dask_cuda]


def kubernetes():
    # --8<-- [start:kubernetes]
    from dask_kubernetes.operator import KubeCluster
    cluster = KubeCluster(name="cerebro", image="my-registry/cerebro-worker:latest",  # torch + cerebro_automl
                          worker_command=["dask", "worker", "--nthreads", "1"])
    search_on(cluster, workers=8)
    # --8<-- [end:kubernetes]


if __name__ == "__main__":
    # The cluster managers are not installed here; the pattern runs on a LocalCluster
    # started with no workers, which, like a batch queue, brings them up later.
    with LocalCluster(n_workers=0, threads_per_worker=1, dashboard_address=None) as cluster:
        result = search_on(cluster, workers=2)
    assert result.best_config["width"] == 32
    for name, run in (("dask_jobqueue", slurm), ("dask_jobqueue", slurm_gpus), ("dask_cuda", dask_cuda),
                      ("dask_kubernetes", kubernetes)):
        if importlib.util.find_spec(name) is None:
            print(f"{name} is not installed: {run.__name__}() not run")
