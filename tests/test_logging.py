"""What a user sees with no logging set up: the library's lines on stderr.

The subprocess tests are the honest ones: under pytest the root logger has
pytest's own handlers, so the default handler rightly steps aside there.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import cerebro_automl.log as cl
from cerebro_automl import Session
from cerebro_automl.adapters.search import grid_search

TESTS = Path(__file__).parent

# A grid search with one config that fails (a str learning rate), and nothing
# configured: no logging.basicConfig, no handler, no verbosity.
SEARCH = """
import sys
sys.path.insert(0, {tests!r})
from conftest import make_arrays
from models import make_spec
from cerebro_automl import PartitionedDataset
from cerebro_automl.adapters.search import grid_search

def search(**session):
    X, y, Xv, yv = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    return grid_search(make_spec(), data, {{"lr": [0.01, "not-a-number"], "width": [8]}}, epochs=2,
                       metric="val_accuracy", mode="max", **session)

if __name__ == "__main__":
{body}
"""


def _run(body: str, timeout: float = 180) -> subprocess.CompletedProcess:
    script = SEARCH.format(tests=str(TESTS), body=textwrap.indent(textwrap.dedent(body), "    "))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_with_no_logging_configured_a_failing_model_warning_reaches_stderr():
    """The issue's new user: a search on a real LocalCluster, nothing configured.
    stderr shows the start with the dashboard link, the failure with its config
    and first error line, one line per finished model, and the end."""
    done = _run('search(n_workers=2)  # executor="dask": a real LocalCluster')
    err = done.stderr
    assert re.search(r"\[I \d\d:\d\d:\d\d cerebro\] session started: 2 partitions on 2 workers "
                     r"\(DaskExecutor\), order=fixed, seed=0, threads=1; "
                     r"Dask dashboard: http://\S+/status", err), err
    failed = re.search(r"\[W \d\d:\d\d:\d\d cerebro\] model 1 \(model-1\) failed: (.*); config (.*)", err)
    assert failed, err
    assert failed.group(1).startswith("TypeError: ")  # the first line of the error, not the traceback
    assert failed.group(2) == "{'lr': 'not-a-number', 'width': 8}"
    # the traceback is kept, not printed: neither by us nor as Dask's "Compute Failed" block
    assert "Compute Failed" not in err and "optimizer_fn" not in err
    assert re.search(r"model 0 finished \(\d of 2\): val_accuracy=0\.\d+ after 2 epochs", err), err
    assert "session ended after" in err and "(1 paused, 1 failed)" in err
    assert "epoch 1:" not in err  # model-epoch lines are DEBUG
    assert done.stdout == ""


def test_a_users_own_logging_configuration_takes_over():
    """basicConfig: every line once, in the user's format; none from the default handler."""
    done = _run("""
        import logging
        logging.basicConfig(format="USER %(levelname)s %(name)s: %(message)s")
        search(executor="local", n_workers=2)
    """)
    lines = done.stderr.splitlines()
    assert "USER WARNING cerebro_automl: model 1 (model-1) failed: TypeError: " \
           "'<=' not supported between instances of 'float' and 'str'; " \
           "config {'lr': 'not-a-number', 'width': 8}" in lines
    assert any(line.startswith("USER INFO cerebro_automl: session started") for line in lines)
    assert not any("cerebro]" in line for line in lines)  # nothing printed twice


def test_a_handler_on_the_library_logger_takes_over_too():
    done = _run("""
        import logging
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("OWN %(message)s"))
        logging.getLogger("cerebro_automl").addHandler(handler)
        search(executor="local", n_workers=2)
    """)
    assert "OWN model 1 (model-1) failed" in done.stdout
    assert "cerebro]" not in done.stderr


def test_verbosity_and_the_default_handler_switches():
    done = _run("""
        import cerebro_automl.log as cl
        cl.set_verbosity(cl.WARNING)
        search(executor="local", n_workers=2)
        print("--- debug", file=sys.stderr)
        cl.set_verbosity("DEBUG")
        search(executor="local", n_workers=2)
        print("--- disabled", file=sys.stderr)
        cl.set_verbosity(cl.INFO)
        cl.disable_default_handler()
        search(executor="local", n_workers=2)
        print("--- enabled", file=sys.stderr)
        cl.enable_default_handler()
        search(executor="local", n_workers=2)
    """)
    warning, debug, disabled, enabled = re.split(r"--- \w+\n", done.stderr)
    assert "failed: TypeError" in warning and "[I " not in warning
    assert re.search(r"\[D \S+ cerebro\] model 0 epoch 1: \{'train_loss'", debug)
    # with no handler at all, Python's last resort prints warnings only, plain
    assert disabled.startswith("model 1 (model-1) failed: TypeError") and "cerebro]" not in disabled
    assert len(disabled.splitlines()) == 1
    assert "session started" in enabled and "[D " not in enabled


def test_a_level_set_before_the_import_is_kept():
    """logging.getLogger("cerebro_automl").setLevel(WARNING) before the import: the
    library does not put INFO back."""
    script = textwrap.dedent("""
        import logging
        logging.getLogger("cerebro_automl").setLevel(logging.WARNING)
        import cerebro_automl.log as cl
        print(cl.get_verbosity())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(logging.WARNING)]


def test_caplog_sees_the_librarys_records(spec, data, caplog):
    """The logger propagates: pytest's caplog (and any root handler) gets every record."""
    with caplog.at_level(logging.DEBUG, logger="cerebro_automl"):
        with Session(spec, data, executor="local") as s:
            s.add({"lr": 0.01, "width": 8}, epochs=1)
            s.add({"lr": "bad", "width": 8}, epochs=1)
            s.run()
    messages = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "cerebro_automl"]
    assert any(level == "INFO" and m.startswith("session started: 3 partitions on 1 workers (LocalExecutor)")
               for level, m in messages)
    assert any(level == "WARNING" and m.startswith("model 1 (model-1) failed: TypeError") for level, m in messages)
    assert any(level == "DEBUG" and m.startswith("model 0 epoch 1: ") for level, m in messages)
    assert messages[-1] == ("INFO", messages[-1][1]) and "1 paused, 1 failed" in messages[-1][1]


def test_tuner_decisions_are_one_line_each(spec, data, caplog):
    from cerebro_automl.adapters.hyperband import successive_halving
    caplog.set_level(logging.INFO, logger="cerebro_automl")
    configs = [{"lr": lr, "width": 8} for lr in (0.05, 0.01, 0.003, 0.001)]
    successive_halving(spec, data, configs, min_epochs=1, max_epochs=2, eta=2, metric="val_loss",
                       executor="local", n_workers=2)
    rungs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bracket")]
    assert len(rungs) == 2
    assert re.fullmatch(r"bracket 0 rung 0 at 1 epochs: 2 of 4 models go on to 2 epochs \[\d, \d\], "
                        r"2 stopped, 0 failed; best \S+ \(model \d\)", rungs[0]), rungs
    assert re.fullmatch(r"bracket 0 done at 2 epochs: best \S+ \(model \d\)", rungs[1]), rungs


def test_grid_search_logs_through_the_default_handler_when_nothing_else_does(spec, data, capsys):
    """In process, with pytest's root handlers set aside, the default handler prints."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        grid_search(spec, data, {"lr": [0.01], "width": [8]}, epochs=1, metric="val_loss",
                    executor="local")
    finally:
        root.handlers[:] = saved
    err = capsys.readouterr().err
    assert "cerebro] session started" in err and "cerebro] best: model 0" in err


@pytest.mark.parametrize("level, error", [("LOUD", ValueError), (2.5, TypeError), (True, TypeError)])
def test_set_verbosity_refuses_what_is_not_a_level(level, error):
    with pytest.raises(error, match="level is"):
        cl.set_verbosity(level)
    assert cl.get_verbosity() == cl.INFO
