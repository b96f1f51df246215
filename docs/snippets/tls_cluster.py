from tiny import data, spec

if __name__ == "__main__":
    # --8<-- [start:tls]
    from distributed import Client
    from distributed.security import Security
    from cerebro_automl import Session
    from cerebro_automl.executors.dask.cluster import start_local_cluster

    security = Security.temporary()    # or Security(tls_ca_file="ca.pem", tls_client_cert="client.pem",
                                       #   tls_client_key="client.key", require_encryption=True)
    cluster = start_local_cluster(1, security=security)
    with Client(cluster, security=security) as client, Session(spec, data, client=client) as s:
        s.add({"lr": 1e-3, "width": 32}, epochs=1)
        s.run()
    # --8<-- [end:tls]
    assert cluster.scheduler_address.startswith("tls://")
    cluster.close()
