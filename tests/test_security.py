"""A run on a TLS-secured cluster; clients without the cluster's certificates are refused;
nothing is ever unpickled from disk."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from distributed import Client

from cerebro_automl.adapters.search import grid_search
from cerebro_automl.executors.dask import start_local_cluster

from models import make_spec

pytest.importorskip("cryptography")
pytestmark = pytest.mark.cluster


@pytest.mark.timeout(180)
def test_a_run_on_a_tls_cluster_works_and_strangers_are_refused(data):
    from distributed.security import Security

    security = Security.temporary()  # a fresh CA and certificate, made here
    with start_local_cluster(2, security=security) as cluster:
        assert cluster.scheduler_address.startswith("tls://")
        with Client(cluster, security=security) as client:
            result = grid_search(make_spec(), data, {"lr": [1e-2], "width": [8, 16]}, epochs=2,
                                 client=client)
            assert len(result.history) == 4
            assert all(address.startswith("tls://") for address in client.scheduler_info()["workers"])
        with pytest.raises(TypeError, match="TLS expects a `ssl_context`"):
            Client(cluster.scheduler_address, timeout=5)  # no certificates at all
        with pytest.raises(OSError):
            Client(cluster.scheduler_address, security=Security.temporary(), timeout=5)  # another CA


def test_nothing_reads_a_pickle_from_disk():
    """Checkpoints load with torch.load(weights_only=True); no pickle.load / torch.load without it.
    The one unpickling allowed is of task data that Dask delivered to a worker (the
    executor's task payloads, the same trust as Dask's own unpickling), marked so."""
    package = Path(__file__).resolve().parents[1]
    sources = [*(package / "cerebro_automl").rglob("*.py"), *(package / "adapters").rglob("*.py")]
    for path in sources:
        text = path.read_text()
        if path.match("executors/dask/wire.py"):
            text = "\n".join(line for line in text.splitlines() if not line.endswith("# task data, as Dask's own"))
        assert not re.search(r"pickle\.loads?\(|cloudpickle\.loads?\(|np\.load\(.*allow_pickle=True", text), path
        for line in re.findall(r"torch\.load\(.*", text):
            assert "weights_only=True" in line, (path, line)
