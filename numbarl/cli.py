"""numbarl's command-line entry points (click): numbarl-train, numbarl-data, numbarl-backtest,
numbarl-compare, numbarl-bench, numbarl-sweep.

The CLI only maps options onto the config and turns expected errors (bad data,
bad config, not a run, an --out that cannot be written) into one line on stderr and exit code 2.
Conventions every command keeps: -h/--help and --version; Ctrl-C exits 130 and SIGTERM 143 with a
message (numbarl-train names the `--resume` command that continues the run). The backend (GPU or
simulator) is chosen before anything imports numba.cuda.
"""

from __future__ import annotations

import signal
import sys

import click

from numbarl import __version__
from numbarl.cuda import backend

EXIT_USAGE = 2
EXIT_SIGINT = 130  # 128 + SIGINT: what shells report for a command stopped by Ctrl-C
EXIT_SIGTERM = 143  # 128 + SIGTERM
CONTEXT = {"help_option_names": ["-h", "--help"]}


def _version(prog: str):
    return click.version_option(__version__, "--version", prog_name=prog, message="%(prog)s %(version)s")


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler or `kill` stopping the job): unwinds like Ctrl-C, so that files are
    closed and the message names how to continue."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _handle_sigterm():
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (e.g. a test runner's worker): keep the default
        pass


def _interrupted(prog: str, cause: BaseException, hint: str = ""):
    """One line for a Ctrl-C/SIGTERM stop, and the conventional exit code."""
    terminated = isinstance(cause, Terminated)
    click.echo(f"{prog}: {'terminated (SIGTERM)' if terminated else 'interrupted (Ctrl-C)'}{hint}", err=True)
    sys.exit(EXIT_SIGTERM if terminated else EXIT_SIGINT)


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
@click.command(context_settings=CONTEXT)
@_version("numbarl-train")
@click.option("--data", "data", default=None, help="fxcache folder, DBN/CSV files (comma separated) or 'synthetic' (default).")
@click.option("--preset", default=None, help="tiny | small | default | large | temporal (default: the config file's preset, else 'default' on a GPU, 'tiny' on the simulator).")
@click.option("--config", "config_file", default=None, type=click.Path(), help="TOML or JSON config file (examples/config.toml; a run's config.json works too).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override one field, e.g. --set agent.lr=3e-4 (repeatable; any field of numbarl/config.py or numbarl/env/params.py).")
@click.option("--print-config", is_flag=True, help="Print the resolved config as TOML (loadable with --config) and exit without training.")
@click.option("--seed", type=int, default=None, help="Training seed.")
@click.option("--folds", type=int, default=None, help="Walk-forward folds.")
@click.option("--epochs", type=int, default=None, help="Epochs per fold.")
@click.option("--out", "out_dir", default=None, type=click.Path(), help="Run folder (default runs/<timestamp>).")
@click.option("--resume", "resume_dir", default=None, type=click.Path(), help="Continue the run in this folder from its last checkpoint.")
@click.option("--no-graph", is_flag=True, help="Run the steps eagerly instead of replaying CUDA graphs (same numbers).")
@click.option("--device", type=int, default=None, help="CUDA device index (sets CUDA_VISIBLE_DEVICES).")
@click.option("--simulate", is_flag=True, help="Force the numba CUDA simulator even on a GPU machine (kernel debugging).")
@click.option("--quiet", is_flag=True, help="Plain log lines only.")
def train_cmd(data, preset, config_file, sets, print_config, seed, folds, epochs, out_dir, resume_dir, no_graph, device,
              simulate, quiet):
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
    _handle_sigterm()
    sim = backend.select(True if simulate else None)
    try:
        from numbarl.run import trainer

        if print_config:
            click.echo(trainer.main(data=data, preset=preset, config_file=config_file, sets=sets, seed=seed,
                                    folds=folds, epochs=epochs, graph=not no_graph, print_config=True,
                                    default_preset="tiny" if sim else "default"), nl=False)
            return
        if sim and not simulate:
            what = " (tiny preset unless --preset or the config names one)" if preset is None and not resume_dir else ""
            click.echo(f"numbarl: no CUDA GPU found: running under the numba CUDA simulator{what}.", err=True)
        trainer.main(data=data, preset=preset, config_file=config_file, sets=sets, seed=seed, folds=folds,
                     epochs=epochs, out_dir=out_dir, resume_dir=resume_dir, graph=not no_graph,
                     simulator=sim, quiet=quiet, default_preset="tiny" if sim else "default")
    except _expected_errors() as e:
        _fail(e)
    except KeyboardInterrupt as e:  # before the trainer started (imports, backend)
        _interrupted("numbarl-train", e, "; nothing was written")
    except Exception as e:  # noqa: BLE001
        from numbarl.run.trainer import Interrupted, NonFiniteError

        if isinstance(e, NonFiniteError):
            _fail(e, 3)
        if isinstance(e, Interrupted):
            # --resume continues from the last checkpoint, or starts the run over in its folder when
            # none was saved yet: either way it is the command to give
            hint = (f"; continue with `numbarl-train --resume {e.run_path}`" if e.run_path is not None
                    else "; no run folder was made yet")
            _interrupted("numbarl-train", e.cause, hint)
        raise


def train_main():
    train_cmd(prog_name="numbarl-train")


# ---------------------------------------------------------------------------------------------
# numbarl-backtest
# ---------------------------------------------------------------------------------------------
@click.command(context_settings=CONTEXT)
@_version("numbarl-backtest")
@click.argument("run_dir", type=click.Path())
@click.option("--checkpoint", default="best", show_default=True, help="best (each fold's best-by-validation checkpoint), latest, a saved tag, or 'all' (every saved checkpoint, one row each: a diagnostic). A checkpoint is scored on its own fold only.")
@click.option("--data", default=None, help="Score on other data (fxcache folder or DBN files) instead of the run's own.")
@click.option("--split", type=click.Choice(["val", "test", "all"]), default="test", show_default=True)
@click.option("--fold", type=int, default=None, help="Fold to score (default: every fold).")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON.")
@click.option("--simulate", is_flag=True, help="Force the numba CUDA simulator.")
def backtest_cmd(run_dir, checkpoint, data, split, fold, as_json, simulate):
    """Re-score a saved agent on a split and print the metrics table."""
    _handle_sigterm()
    backend.select(True if simulate else None)
    try:
        from numbarl.run import trainer

        trainer.backtest_main(run_dir=run_dir, checkpoint=checkpoint, data=data, split=split, fold=fold, as_json=as_json)
    except _expected_errors() as e:
        _fail(e)
    except KeyboardInterrupt as e:
        _interrupted("numbarl-backtest", e, " (it only reads the run folder: nothing was changed)")


def backtest_main():
    backtest_cmd(prog_name="numbarl-backtest")


# ---------------------------------------------------------------------------------------------
# numbarl-compare
# ---------------------------------------------------------------------------------------------
@click.command(context_settings=CONTEXT)
@_version("numbarl-compare")
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
    except KeyboardInterrupt as e:
        _interrupted("numbarl-compare", e)


def compare_main():
    compare_cmd(prog_name="numbarl-compare")


# ---------------------------------------------------------------------------------------------
# numbarl-bench
# ---------------------------------------------------------------------------------------------
BENCHES = {"runtime": "numbarl.bench.runtime", "kernels": "numbarl.bench.kernels",
           "env": "numbarl.bench.env", "head": "numbarl.bench.head", "train": "numbarl.bench.train",
           "ppo": "numbarl.bench.ppo", "dt": "numbarl.bench.dt", "components": "numbarl.bench.components",
           "gemm": "numbarl.bench.gemm"}


BENCH_HELP = {"runtime": "Launch overhead (graph vs eager) and GEMM throughput vs torch.matmul.",
              "kernels": "Deterministic reductions.", "env": "Env steps/s and backtest bar-steps/s vs the CPU reference.",
              "head": "The C51 head's dueling softmax per pass.",
              "train": "Train step vs PyTorch (eager, CUDA-graphed) and JAX; --profile lists GPU time per kernel.",
              "ppo": "PPO env-steps/s including its update, vs a PyTorch PPO on the same shapes.",
              "dt": "Decision Transformer train step and acting step vs a PyTorch DT on the same shapes.",
              "components": "ms each registry component adds to the c51 train step (and collect step), with its liveness.",
              "gemm": "Every cuBLASLt GEMM of the collect and train steps: the heuristic's candidates timed; "
                      "--write-tuning for NUMBARL_GEMM_TUNING.",
              "all": "Every benchmark, one after the other."}


@click.group(context_settings=CONTEXT)
@_version("numbarl-bench")
@click.option("--simulate", is_flag=True, help="Force the numba CUDA simulator (only the runtime --check makes sense there).")
def bench_cmd(simulate):
    """GPU benchmarks; `numbarl-bench WHAT --help` lists a benchmark's own options. Results and the
    exact commands: docs/BENCHMARKS.md."""


def _bench_command(what: str):
    # the options belong to each benchmark's own parser (argparse): click passes them through,
    # --help included, so `numbarl-bench train --help` shows the train benchmark's options
    @bench_cmd.command(what, help=BENCH_HELP[what], add_help_option=False,
                       context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    @click.pass_context
    def command(ctx, args):
        args = list(args)
        if "--version" in args:  # every command answers --version (the benchmark parsers do not know it)
            click.echo(f"numbarl-bench {__version__}")
            return
        simulate = ctx.parent.params.get("simulate") or "--simulate" in args
        args = [a for a in args if a != "--simulate"]  # accepted after WHAT too, as before
        _handle_sigterm()
        backend.select(True if simulate else None)
        import importlib

        try:
            for name in (list(BENCHES) if what == "all" else [what]):
                module = importlib.import_module(BENCHES[name])
                # components --profile leaves by os._exit once written (after CUPTI; numbarl/bench/components.py)
                code = module.main(args, exit_after_profile=True) if name == "components" else module.main(args)
                if code:  # a benchmark that could not run (no GPU, bad option) is not a success
                    sys.exit(code)
        except KeyboardInterrupt as e:
            _interrupted("numbarl-bench", e)

    return command


for _what in (*BENCHES, "all"):
    _bench_command(_what)


def bench_main():
    bench_cmd(prog_name="numbarl-bench")


# ---------------------------------------------------------------------------------------------
# numbarl-data (the command group lives with the data package)
# ---------------------------------------------------------------------------------------------
def data_main():
    from numbarl.data.commands import data_main as _data_main

    _data_main()


# ---------------------------------------------------------------------------------------------
# numbarl-sweep (Ray Tune: numbarl/run/sweep.py, docs/SWEEPS.md)
# ---------------------------------------------------------------------------------------------
@click.command(context_settings=CONTEXT)
@_version("numbarl-sweep")
@click.option("--preset", default=None, help="tiny | small | default | large | temporal (or a --config that names one).")
@click.option("--config", "config_file", default=None, type=click.Path(), help="TOML or JSON config file every trial starts from (copied into the sweep folder).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override one field in every trial (repeatable).")
@click.option("--grid", multiple=True, metavar="KEY=V1,V2", help="Sweep a field over these values (repeatable: the grids multiply).")
@click.option("--random", "random_", multiple=True, metavar="KEY=LO:HI[:log]", help="Draw a numeric field uniformly (log: log-uniformly), --samples draws (repeatable).")
@click.option("--samples", type=int, default=1, show_default=True, help="Random draws, each combined with every grid point.")
@click.option("--sample-seed", type=int, default=0, show_default=True, help="Seed of the --random draws.")
@click.option("--seeds", default=None, metavar="S1,S2,...", help="Training seeds: every grid point runs once per seed.")
@click.option("--out", "out_dir", default=None, type=click.Path(), help="Sweep folder (new, or the sweep to continue with --resume).")
@click.option("--gpus-per-trial", type=float, default=None, help="GPUs per trial; 0.25 packs four trials on a GPU (default: 1 when the Ray cluster has GPUs, else 0).")
@click.option("--cpus-per-trial", type=float, default=1.0, show_default=True, help="CPUs Ray reserves per trial.")
@click.option("--address", default=None, help="Join this Ray cluster (e.g. auto, or HOST:6379 of `ray start --head`) instead of starting a local Ray.")
@click.option("--resume", is_flag=True, help="Continue the sweep in --out: finished trials stay, interrupted ones resume from their checkpoints.")
@click.option("--asha", is_flag=True, help="Stop trials early (ASHA) on each epoch's validation Sharpe.")
@click.option("--asha-grace", type=int, default=1, show_default=True, help="Epochs (over all folds) before ASHA may stop a trial.")
@click.option("--max-concurrent", type=int, default=None, help="Most trials running at once (default: as many as the resources allow).")
def sweep_cmd(preset, config_file, sets, grid, random_, samples, sample_seed, seeds, out_dir, gpus_per_trial,
              cpus_per_trial, address, resume, asha, asha_grace, max_concurrent):
    """Grid and random search over config fields × seeds on Ray Tune: each trial a numbarl-train
    run folder under OUT/trials, the numbarl-compare table in OUT/compare.txt (docs/SWEEPS.md)."""
    from pathlib import Path

    from numbarl.run import sweep  # the standard library only: Ray is imported once the arguments are checked

    _handle_sigterm()
    try:
        code = sweep.main(preset=preset, config_file=config_file, sets=sets, grid=grid, random=random_,
                          samples=samples, sample_seed=sample_seed, seeds=seeds, out_dir=out_dir,
                          gpus_per_trial=gpus_per_trial, cpus_per_trial=cpus_per_trial, address=address,
                          resume=resume, asha=asha, asha_grace=asha_grace, max_concurrent=max_concurrent)
    except (*_expected_errors(), sweep.SweepError) as e:
        _fail(e)
    except KeyboardInterrupt as e:
        made = out_dir and (Path(out_dir) / sweep.SWEEP_FILE).is_file()
        _interrupted("numbarl-sweep", e, f"; continue with `numbarl-sweep --out {out_dir} --resume`" if made else
                     "; nothing was written")
    sys.exit(code)


def sweep_main():
    sweep_cmd(prog_name="numbarl-sweep")
