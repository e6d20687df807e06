"""`python -m numbarl train|data|backtest|compare|bench ...`: the console scripts without installing
(e.g. running from source on an offline GPU host, see docs/OFFLINE.md)."""

import sys

from numbarl import cli

COMMANDS = {"train": cli.train_cmd, "backtest": cli.backtest_cmd, "compare": cli.compare_cmd, "bench": cli.bench_cmd}


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in (*COMMANDS, "data"):
        print("usage: python -m numbarl {train|data|backtest|compare|bench} [options]", file=sys.stderr)
        sys.exit(2)
    name, args = sys.argv[1], sys.argv[2:]
    if name == "data":
        from numbarl.data.commands import data_group

        data_group(args, prog_name="numbarl-data")
    else:
        COMMANDS[name](args, prog_name=f"numbarl-{name}")


if __name__ == "__main__":
    main()
