from tiny import data, spec

if __name__ == "__main__":
    from cerebro_automl.executors.dask.cluster import start_local_cluster
    from distributed import Client
    cluster = start_local_cluster(2)
    client = Client(cluster)
    # --8<-- [start:gangs]
    from cerebro_automl.adapters.hyperband import asha

    def sampler(rng):
        return {"lr": float(10 ** rng.uniform(-4, -2)), "width": int(rng.choice([16, 32, 64]))}

    # The last survivors train on both workers at once (each rank 8 of the 16 rows a step).
    result = asha(spec, data, sampler, min_epochs=1, max_epochs=4, eta=2, max_trials=8,
                  metric="val_accuracy", mode="max", client=client, gang=True, reproducible=True)
    result.best_config
    # --8<-- [end:gangs]
    assert result.epochs_trained > 0
    client.close()
    cluster.close()
