"""`python -m numbarl train|data|backtest|compare|sweep|bench|components|ab ...`: the console scripts without installing
(e.g. running from source on an offline GPU host, see docs/OFFLINE.md)."""

import sys

from numbarl import __version__, cli

COMMANDS = {"train": cli.train_cmd, "backtest": cli.backtest_cmd, "compare": cli.compare_cmd, "sweep": cli.sweep_cmd, "bench": cli.bench_cmd}
USAGE = """usage: python -m numbarl {train|data|backtest|compare|sweep|bench|components|ab} [options]

  train      numbarl-train: train an agent, walk-forward validation and out-of-sample test
  data       numbarl-data: build, generate, inspect and export feature caches
  backtest   numbarl-backtest: re-score a saved agent
  compare    numbarl-compare: several runs side by side
  sweep      numbarl-sweep: grid/random search over config fields x seeds on Ray Tune
  bench      numbarl-bench: GPU benchmarks
  components every learning component: --set switch, reference, tests, liveness key [--json]
  ab         an A/B grid (arms x seeds) of training runs side by side, and one comparison table

`python -m numbarl COMMAND --help` shows a command's options."""


def main():
    if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0)
    if len(sys.argv) >= 2 and sys.argv[1] == "--version":
        print(f"numbarl {__version__}")
        sys.exit(0)
    if len(sys.argv) < 2 or sys.argv[1] not in (*COMMANDS, "data", "components", "ab"):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    name, args = sys.argv[1], sys.argv[2:]
    if name == "ab":
        from numbarl.run import ab

        sys.exit(ab.main(args))
    if name == "components":
        from numbarl.rl import components

        sys.exit(components.main(args))
    if name == "data":
        from numbarl.data.commands import data_main

        data_main(args)
    else:
        COMMANDS[name](args, prog_name=f"numbarl-{name}")


if __name__ == "__main__":
    main()
