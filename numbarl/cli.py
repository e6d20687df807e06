"""numbarl's command-line entry points (click): numbarl-train, numbarl-data, numbarl-backtest,
numbarl-compare, numbarl-bench.

The CLI only maps options onto the config (STYLE rule 5) and turns expected errors (bad data,
bad config, not a run) into one line on stderr and exit code 2. The backend (GPU or simulator)
is chosen before anything imports numba.cuda.
"""

from __future__ import annotations

import sys

import click

from numbarl.cuda import backend

EXIT_USAGE = 2


def _expected_errors():
    """Exception types that are the user's input, not numbarl's bug (imported lazily)."""
    from numbarl.config import ConfigError
    from numbarl.data.errors import DataError
    from numbarl.run.runio import RunError

    return (ConfigError, DataError, RunError)


def _fail(e: Exception, code: int = EXIT_USAGE):
    click.echo(f"error: {e}", err=True)
    sys.exit(code)


# ---------------------------------------------------------------------------------------------
# numbarl-train
# ---------------------------------------------------------------------------------------------
@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--data", "data", default=None, help="fxcache folder, DBN/CSV files (comma separated) or 'synthetic' (default).")
@click.option("--preset", default=None, help="tiny | small | default | large (default: 'default' on a GPU, 'tiny' on the simulator).")
@click.option("--config", "config_file", default=None, type=click.Path(), help="TOML or JSON config file.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override one field, e.g. --set agent.lr=3e-4 (repeatable).")
@click.option("--seed", type=int, default=None, help="Training seed.")
@click.option("--folds", type=int, default=None, help="Walk-forward folds.")
@click.option("--epochs", type=int, default=None, help="Epochs per fold.")
@click.option("--out", "out_dir", default=None, type=click.Path(), help="Run folder (default runs/<timestamp>).")
@click.option("--resume", "resume_dir", default=None, type=click.Path(), help="Continue the run in this folder from its last checkpoint.")
@click.option("--no-graph", is_flag=True, help="Run the steps eagerly instead of replaying CUDA graphs (same numbers).")
@click.option("--device", type=int, default=None, help="CUDA device index (sets CUDA_VISIBLE_DEVICES).")
@click.option("--simulate", is_flag=True, help="Force the numba CUDA simulator even on a GPU machine (kernel debugging).")
@click.option("--quiet", is_flag=True, help="Plain log lines only.")
def train_cmd(data, preset, config_file, sets, seed, folds, epochs, out_dir, resume_dir, no_graph, device, simulate, quiet):
    """Train a distributional DQN trading agent with walk-forward validation and an
    out-of-sample test, and write a run folder with metrics, checkpoints and a report."""
    import os

    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
    if resume_dir:  # a resumed run continues with its saved config: other settings would be ignored
        given = [name for name, value in (("--data", data), ("--preset", preset), ("--config", config_file),
                                          ("--set", sets), ("--seed", seed), ("--folds", folds),
                                          ("--epochs", epochs), ("--out", out_dir)) if value not in (None, ())]
        if given:
            _fail(f"--resume continues the run in {resume_dir} with its saved config (config.json); "
                  f"{', '.join(given)} cannot be combined with it. Start a new run "
                  "with --out to train with other settings.")
    sim = backend.select(True if simulate else None)
    try:
        from numbarl.run import trainer

        if sim and not simulate:
            what = " (tiny preset)" if preset is None and not resume_dir else ""
            click.echo(f"numbarl: no CUDA GPU found: running under the numba CUDA simulator{what}.", err=True)
        if preset is None:
            preset = "tiny" if sim else "default"
        trainer.main(data=data, preset=preset, config_file=config_file, sets=sets, seed=seed, folds=folds,
                     epochs=epochs, out_dir=out_dir, resume_dir=resume_dir, graph=not no_graph,
                     simulator=sim, quiet=quiet)
    except _expected_errors() as e:
        _fail(e)
    except Exception as e:  # noqa: BLE001
        from numbarl.run.trainer import NonFiniteError

        if isinstance(e, NonFiniteError):
            _fail(e, 3)
        raise


def train_main():
    train_cmd(prog_name="numbarl-train")


# ---------------------------------------------------------------------------------------------
# numbarl-backtest
# ---------------------------------------------------------------------------------------------
@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=click.Path())
@click.option("--checkpoint", default="best", show_default=True, help="best (each fold's best-by-validation checkpoint), latest, a saved tag, or 'all' (every saved checkpoint, one row each: a diagnostic). A checkpoint is scored on its own fold only.")
@click.option("--data", default=None, help="Score on other data (fxcache folder or DBN files) instead of the run's own.")
@click.option("--split", type=click.Choice(["val", "test", "all"]), default="test", show_default=True)
@click.option("--fold", type=int, default=None, help="Fold to score (default: every fold).")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON.")
@click.option("--simulate", is_flag=True, help="Force the numba CUDA simulator.")
def backtest_cmd(run_dir, checkpoint, data, split, fold, as_json, simulate):
    """Re-score a saved agent on a split and print the metrics table."""
    backend.select(True if simulate else None)
    try:
        from numbarl.run import trainer

        trainer.backtest_main(run_dir=run_dir, checkpoint=checkpoint, data=data, split=split, fold=fold, as_json=as_json)
    except _expected_errors() as e:
        _fail(e)


def backtest_main():
    backtest_cmd(prog_name="numbarl-backtest")


# ---------------------------------------------------------------------------------------------
# numbarl-compare
# ---------------------------------------------------------------------------------------------
@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print rows, spread and config differences as JSON.")
def compare_cmd(run_dirs, as_json):
    """Out-of-sample results of several runs (e.g. a seed sweep) side by side: one row per run
    and fold from each summary.json, the spread of the test numbers, and the config fields that
    differ. Reads files only (no GPU)."""
    try:
        from numbarl.run import compare

        click.echo(compare.main(run_dirs, as_json=as_json))
    except _expected_errors() as e:
        _fail(e)


def compare_main():
    compare_cmd(prog_name="numbarl-compare")


# ---------------------------------------------------------------------------------------------
# numbarl-bench
# ---------------------------------------------------------------------------------------------
BENCHES = {"runtime": "numbarl.bench.runtime", "kernels": "numbarl.bench.kernels",
           "env": "numbarl.bench.env", "head": "numbarl.bench.head", "train": "numbarl.bench.train"}


@click.command(context_settings={"help_option_names": ["-h", "--help"], "ignore_unknown_options": True})
@click.argument("what", type=click.Choice(list(BENCHES) + ["all"]))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--simulate", is_flag=True, help="Force the numba CUDA simulator (only --check makes sense there).")
def bench_cmd(what, args, simulate):
    """GPU benchmarks: runtime (launch overhead, GEMM vs torch), kernels (reductions), env
    (env steps/s, backtest bar-steps/s), head (the C51 head's dueling softmax per pass), train
    (train step vs PyTorch; --profile lists GPU time per kernel), or all."""
    backend.select(True if simulate else None)
    import importlib

    for name in (list(BENCHES) if what == "all" else [what]):
        importlib.import_module(BENCHES[name]).main(list(args))


def bench_main():
    bench_cmd(prog_name="numbarl-bench")


# ---------------------------------------------------------------------------------------------
# numbarl-data (the command group lives with the data package)
# ---------------------------------------------------------------------------------------------
def data_main():
    from numbarl.data.commands import data_main as _data_main

    _data_main()
