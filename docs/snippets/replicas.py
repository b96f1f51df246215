from tiny import data, spec

if __name__ == "__main__":
    from cerebro_automl.executors.dask.cluster import start_local_cluster
    from distributed import Client
    cluster = start_local_cluster(2)
    client = Client(cluster)
    # --8<-- [start:replicas]
    from cerebro_automl import Session

    with Session(spec, data, client=client, replicas=2, speculate=True) as s:
        s.add({"lr": 1e-3, "width": 32}, epochs=1)
        s.run()
    # tuners pass it through: optimize(study, spec, data, space, ..., replicas=2)
    # --8<-- [end:replicas]
    client.close()
    cluster.close()
