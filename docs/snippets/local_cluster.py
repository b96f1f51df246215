from tiny import data, spec

if __name__ == "__main__":
    # --8<-- [start:local]
    from cerebro_automl import Session

    with Session(spec, data, n_workers=2) as s:     # a LocalCluster of 2 single-threaded workers
        s.add({"lr": 1e-3, "width": 32}, epochs=1)
        s.run()
    with Session(spec, data, executor="local") as s:  # in-process and serial: debugging, the same bits
        s.add({"lr": 1e-3, "width": 32}, epochs=1)
        s.run()
    # --8<-- [end:local]
