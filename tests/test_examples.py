"""The Optuna demo on a Dask cluster started from the command line, as a user who
already runs one would: `examples/optuna_mnist1d.py --scheduler ...` or
`--scheduler-file ...`, with the workers as `dask worker` processes that do not
have the examples folder on their path (the script sends its model code)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import Client

from conftest import cli_cluster, cli_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "optuna_mnist1d.py"
# The command line the README and the manual show for the demo on an existing cluster.
DOCUMENTED = "python examples/optuna_mnist1d.py --scheduler-file sched.json"
TINY = ("--trials", "3", "--epochs", "2", "--samples", "600", "--partitions", "2", "--workers", "2")


def run_example(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], check=False, cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def documented_commands() -> dict[str, list[str]]:
    """Page -> the demo command lines with a --scheduler flag it shows, comments cut."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    command = re.compile(r"^(python examples/optuna_mnist1d\.py .*?--scheduler.*?)(?:\s+#.*)?$", re.M)
    found = {str(page.relative_to(ROOT)): command.findall(page.read_text()) for page in pages}
    return {page: lines for page, lines in found.items() if lines}


def test_the_manual_shows_the_demo_command_that_is_run_here():
    shown = documented_commands()
    assert {"README.md", "docs/index.md", "docs/guides/clusters/cli.md", "docs/guides/tuners/optuna.md"} <= set(shown)
    for page, lines in shown.items():
        assert set(lines) == {DOCUMENTED}, (page, lines)


def tasks_seen(client: Client) -> dict[str, int]:
    """How many tasks of each key prefix the scheduler has seen (its prefixes outlive the tasks)."""
    return client.run_on_scheduler(lambda dask_scheduler: {
        name: sum(prefix.state_counts.values()) for name, prefix in dask_scheduler.task_prefixes.items()})


@pytest.mark.cluster
@pytest.mark.parametrize("how", ["address", "documented"])
def test_the_optuna_demo_runs_on_an_existing_cli_cluster(tmp_path, how):
    env = cli_env()
    with cli_cluster(tmp_path, [env, env], ("--no-nanny",)) as address, Client(address) as client:
        if how == "address":
            flags = ["--scheduler", address]
        else:  # the documented command, run from a folder that holds sched.json
            (tmp_path / "sched.json").write_text((tmp_path / "scheduler.json").read_text())
            flags = shlex.split(DOCUMENTED)[2:]
        done = run_example(*flags, *TINY, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-4000:]
        assert "3 trials on MNIST-1D (480 train / 60 validation / 60 test rows)" in done.stdout, done.stdout
        assert f"on the Dask cluster at {address}" in done.stdout, done.stdout
        # The training ran on this cluster's workers, not on a LocalCluster of the script's own.
        seen = tasks_seen(client)
        assert seen.get("cerebro-train", 0) > 0, seen
        assert len(client.scheduler_info()["workers"]) == 2


@pytest.mark.parametrize("flags, says", [
    (("--scheduler", "tcp://127.0.0.1:8786", "--scheduler-file", "sched.json"), "give one of them"),
    (("--scheduler", "127.0.0.1:8786"), "must be a Dask scheduler address that starts with tcp:// or tls://"),
    (("--scheduler", "http://127.0.0.1:8787"), "'http://127.0.0.1:8787'"),
])
def test_the_demo_refuses_a_cluster_it_cannot_use(tmp_path, flags, says):
    done = run_example(*flags, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
