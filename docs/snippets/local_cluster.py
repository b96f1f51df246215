from tiny import data, spec

# --8<-- [start:local]
from cerebro_automl import Session

# In a script, start the search under this guard: Dask starts each worker process
# with "spawn", which imports the script again (the guard keeps it from starting
# another cluster there).
if __name__ == "__main__":
    with Session(spec, data, n_workers=2) as s:     # a LocalCluster of 2 single-threaded workers
        s.add({"lr": 1e-3, "width": 32}, epochs=1)
        s.run()
    with Session(spec, data, executor="local") as s:  # in-process and serial: debugging, the same bits
        s.add({"lr": 1e-3, "width": 32}, epochs=1)
        s.run()
# --8<-- [end:local]
