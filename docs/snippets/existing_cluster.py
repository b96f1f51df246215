import os
import tempfile

from distributed import LocalCluster

from tiny import data, spec

if __name__ == "__main__":
    os.chdir(tempfile.mkdtemp())
    # What `dask scheduler --scheduler-file sched.json` and a `dask worker` make, here in-process.
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None,
                           scheduler_kwargs={"scheduler_file": "sched.json"})
    # --8<-- [start:cluster]
    import optuna
    from distributed import Client
    from cerebro_automl import Session
    from cerebro_automl.adapters.optuna import optimize

    with Client(scheduler_file="sched.json") as client:    # or Client("tcp://10.0.0.5:8786")
        with Session(spec, data, client=client) as s:       # client= also takes the address itself
            s.add({"lr": 1e-3, "width": 32}, epochs=1)
            s.run()
        study = optuna.create_study(direction="maximize")   # every tuner passes client= on
        optimize(study, spec, data, lambda t: {"lr": t.suggest_float("lr", 1e-3, 1e-2), "width": 32},
                 n_trials=2, epochs=1, metric="val_accuracy", client=client)
    # --8<-- [end:cluster]
    assert len(s.history) == 1 and len(study.trials) == 2
    with Session(spec, data, client=cluster.scheduler_address) as s:  # the address form
        s.add({"lr": 1e-3, "width": 32}, epochs=1)
        s.run()
    cluster.close()
