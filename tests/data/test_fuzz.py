"""The fuzz test: hundreds of mutations of real and synthetic DBN files, their CSV exports, a
LOBSTER pair and a Binance capture, built in a subprocess (a signal or a hang fails the test too).
tests/data/fuzz_inputs.py is the fuzzer; run it by hand with more cases or other seeds."""

import subprocess
import sys
from pathlib import Path

FUZZER = Path(__file__).with_name("fuzz_inputs.py")


def test_no_mutation_gets_past_the_readers(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(FUZZER), str(tmp_path / "fuzz"), "--cases", "500", "--seed", "19", "--budget", "40"],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail  # a negative code is a signal (SIGABRT: -6)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("fuzz: ") and last.split()[1].isdigit(), tail
    cases, errors, caches = (int(last.split()[i]) for i in (1, 3, 5))
    assert cases >= 200 and errors > 50 and caches > 10, last  # the budget bounds the time on a slow machine
    assert " 0 failures" in last, tail
