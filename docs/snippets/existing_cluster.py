from distributed import Client, LocalCluster

from tiny import data, spec

if __name__ == "__main__":
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None)
    address = cluster.scheduler_address             # "tcp://10.0.0.5:8786" on a real cluster
    # --8<-- [start:cluster]
    import optuna
    from cerebro_automl import Session
    from cerebro_automl.adapters.optuna import optimize

    with Session(spec, data, client=address) as s:  # a scheduler address ...
        s.add({"lr": 1e-3, "width": 32}, epochs=1)
    with Client(address) as client:                 # ... or a distributed.Client
        study = optuna.create_study(direction="maximize")
        optimize(study, spec, data, lambda t: {"lr": t.suggest_float("lr", 1e-3, 1e-2), "width": 32},
                 n_trials=2, epochs=1, metric="val_accuracy", client=client)  # passed on to the Session
    # --8<-- [end:cluster]
    assert len(study.trials) == 2
    cluster.close()
