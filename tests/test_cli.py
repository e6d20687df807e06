"""The command-line conventions a user relies on (issue 12): -h/--help/--version on every command,
`python -m numbarl --help`, Ctrl-C/SIGTERM exit codes, numbarl-bench's pass-through options and
its exit code without a GPU, and one `error:` line, exit 2 and nothing written for every --out
that cannot be written."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from numbarl import __version__, cli
from numbarl.data.commands import data_group

COMMANDS = {"numbarl-train": cli.train_cmd, "numbarl-backtest": cli.backtest_cmd,
            "numbarl-compare": cli.compare_cmd, "numbarl-bench": cli.bench_cmd, "numbarl-data": data_group}


@pytest.mark.parametrize("name", sorted(COMMANDS))
@pytest.mark.parametrize("flag", ["-h", "--help", "--version"])
def test_every_command_has_help_and_version(name, flag):
    r = CliRunner().invoke(COMMANDS[name], [flag], prog_name=name)
    assert r.exit_code == 0, r.output + repr(r.exception)
    if flag == "--version":
        assert r.output.strip() == f"{name} {__version__}"
    else:
        assert "Usage:" in r.output


@pytest.mark.parametrize("sub", ["synth", "build", "inspect", "export"])
@pytest.mark.parametrize("flag", ["-h", "--help", "--version"])
def test_data_subcommands_accept_help_and_version(sub, flag):
    r = CliRunner().invoke(data_group, [sub, flag], prog_name="numbarl-data")
    assert r.exit_code == 0, r.output
    assert (r.output.strip() == f"numbarl-data {__version__}") if flag == "--version" else ("Usage:" in r.output)


@pytest.mark.parametrize("sub", ["train", "runtime", "env", "kernels", "head", "all"])
def test_bench_subcommands_accept_version(sub):
    r = CliRunner().invoke(cli.bench_cmd, [sub, "--version"], prog_name="numbarl-bench")
    assert r.exit_code == 0 and r.output.strip() == f"numbarl-bench {__version__}", r.output


def test_components_accepts_help_and_version():
    import subprocess
    import sys

    for flag, want in (("--version", f"numbarl components {__version__}"), ("-h", "usage"), ("--help", "usage")):
        r = subprocess.run([sys.executable, "-m", "numbarl", "components", flag], capture_output=True, text=True)
        assert r.returncode == 0 and want in r.stdout, (flag, r.stdout, r.stderr)


def test_python_dash_m_numbarl_help_and_version():
    for args, want in ((["--help"], "numbarl-train"), (["--version"], __version__), (["-h"], "usage")):
        r = subprocess.run([sys.executable, "-m", "numbarl", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and want in r.stdout, (args, r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "numbarl", "nonsense"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "usage" in r.stderr


def test_bench_train_help_shows_its_own_options():
    r = CliRunner().invoke(cli.bench_cmd, ["train", "--help"], prog_name="numbarl-bench")
    assert r.exit_code == 0, r.output
    for option in ("--json", "--batch", "--n-envs", "--profile"):
        assert option in r.output


def test_bench_train_without_a_gpu_is_an_error_not_a_success(tmp_path):
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(cli.bench_cmd, ["--simulate", "train", "--json", str(out)], prog_name="numbarl-bench")
    assert r.exit_code == 2, r.output + repr(r.exception)
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs a CUDA GPU" in errors[0], r.output
    assert not out.exists()


def test_bench_train_head_pad_rows():
    """--head-pad: its values (0 = the automatic default) are checked before any GPU work, and each extra row is a
    line of its train and collect steps against the first row, with its peer check."""
    from numbarl.bench import train

    assert train.head_pads("0,1,8,0u") == ["0", "1", "8", "0u"]
    assert train.head_pads("0,0s,64us") == ["0", "0s", "64us"]  # s: agent.overlap=false (one stream)
    for bad in ("1,x", "-1", "4,4", "", "1uu", "u", "0u,1", "0,1u", "0,0f", "0s,1", "0,0ss", "s", "0,1us", "0,8su"):
        with pytest.raises(SystemExit, match="--head-pad"):
            train.head_pads(bad)
    row = {"train_step_ms": 1.6, "collect_step_ms": 0.29}
    unfused = {"train_step_ms": 1.35, "collect_step_ms": 0.24}
    results = {"head_pad": "0", "numbarl": {"fp32": {"train_step_ms": 3.2, "collect_step_ms": 0.6}, "tf32":
                                            {"train_step_ms": 1.3, "collect_step_ms": 0.23}, "fp32.pad1": row,
                                            "tf32.pad1": row, "tf32.pad0u": unfused, "tf32.pad0s": unfused},
               "check.pad1": {"available": True, "loss_relerr": 9e-7, "grad_relerr_max": 1e-6}}
    fp32, one, unfuse, serial = train.pad_lines(results)
    assert serial.startswith("agent.head_pad=0 overlap=false (tf32): train 1.350 ms (+0.050 vs head_pad=0)")
    assert "loss rel 9.0e-07" in fp32 and fp32.startswith("agent.head_pad=1 (fp32): train 1.600 ms (-1.600")
    assert one == "agent.head_pad=1 (tf32): train 1.600 ms (+0.300 vs head_pad=0), collect 0.290 ms (+0.060)"
    assert unfuse.startswith("agent.head_pad=0 head_fuse_value=false (tf32): train 1.350 ms (+0.050 vs head_pad=0)")


def test_sigterm_unwinds_like_ctrl_c():
    """The handler turns SIGTERM into an exception, so that the trainer's files are closed and the
    message names how to continue (a default SIGTERM kills silently)."""
    old = signal.getsignal(signal.SIGTERM)
    try:
        cli._handle_sigterm()
        with pytest.raises(cli.Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode
    finally:
        signal.signal(signal.SIGTERM, old)


def test_sigterm_during_training_exits_143_naming_resume(tmp_path, monkeypatch):
    from numbarl.run import trainer

    def terminated(*args, **kwargs):
        raise cli.Terminated()

    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(trainer, "run_training", terminated)
    out = tmp_path / "run"
    r = CliRunner().invoke(cli.train_cmd, ["--preset", "tiny", "--quiet", "--out", str(out)])
    assert r.exit_code == 143, r.output + repr(r.exception)
    assert "terminated (SIGTERM)" in r.output and f"numbarl-train --resume {out}" in r.output
    assert r.output.count(f"numbarl-train --resume {out}") == 1  # one hint on the console, not two
    assert "SIGTERM" in (out / "train.log").read_text() and "--resume" in (out / "train.log").read_text()


# ---------------------------------------------------------------------------------------------
# every --out that cannot be written: one error line, exit 2, nothing written
# ---------------------------------------------------------------------------------------------
def _one_error(r, *needles):
    assert r.exit_code == 2, r.output + repr(r.exception)
    errors = [line for line in r.output.splitlines() if line.startswith(("error:", "numbarl-data: error:"))]
    assert len(errors) == 1, r.output
    assert "Traceback" not in r.output
    for needle in needles:
        assert needle in errors[0], r.output


def _files(root: Path):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("case", ["file_in_path", "file_itself", "read_only_dir", "read_only_parent"])
def test_train_out_that_cannot_be_written(tmp_path, monkeypatch, case):
    from numbarl.run import runio

    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a_file").write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    out, needle = {
        "file_in_path": (tmp_path / "a_file" / "sub", "is a file, not a folder"),
        "file_itself": (tmp_path / "a_file", "a file with that name exists"),
        "read_only_dir": (locked, "not writable"),
        "read_only_parent": (locked / "run", "not writable"),
    }[case]
    real_access = os.access
    # a read-only folder (root, which runs this suite in containers, may write anywhere)
    monkeypatch.setattr(runio.os, "access",
                        lambda p, mode: False if Path(p) == locked and mode & os.W_OK else real_access(p, mode))
    before = _files(tmp_path)
    r = CliRunner().invoke(cli.train_cmd, ["--preset", "tiny", "--quiet", "--out", str(out)])
    _one_error(r, needle)
    assert _files(tmp_path) == before  # no run folder, and the data was not even built


def test_run_folder_creation_failure_is_a_run_error_and_leaves_nothing(tmp_path, monkeypatch):
    from numbarl.run import runio

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(runio.os, "rename", refuse)
    with pytest.raises(runio.RunError, match="cannot create run folder .*Permission denied"):
        runio.RunDir.create(tmp_path / "new" / "deeper" / "run", {"a": 1})
    assert _files(tmp_path) == []


def test_data_export_into_a_file_path(tmp_path):
    from numbarl.data.synth import build_synthetic_cache

    cache = tmp_path / "cache"
    build_synthetic_cache(cache, 4, 1, 0.2, False, events_per_session=300, bars_per_day=20)
    (tmp_path / "a_file").write_text("x")
    before = _files(tmp_path)
    r = CliRunner().invoke(data_group, ["export", str(cache), "--parquet", str(tmp_path / "a_file" / "x.parquet")],
                           prog_name="numbarl-data")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output + repr(r.exception)
    errors = [line for line in r.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and "a_file is a file, not a folder" in errors[0], r.output
    assert _files(tmp_path) == before


def test_gpu_sized_preset_on_the_simulator_warns_and_suggests_tiny(tmp_path, monkeypatch):
    """--preset default under the simulator printed nothing for 10 minutes: now a warning names the
    problem and the preset to use (the bad --out then stops this test's run before any work)."""
    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a_file").write_text("x")
    r = CliRunner().invoke(cli.train_cmd, ["--preset", "default", "--simulate", "--quiet",
                                           "--out", str(tmp_path / "a_file" / "run")])
    warning = [line for line in r.output.splitlines() if "warning:" in line]
    assert len(warning) == 1 and "sized for a GPU" in warning[0] and "--preset tiny" in warning[0], r.output
    r = CliRunner().invoke(cli.train_cmd, ["--preset", "tiny", "--simulate", "--quiet",
                                           "--out", str(tmp_path / "a_file" / "run")])
    assert "warning:" not in r.output


def test_data_inspect_of_a_missing_folder_says_so(tmp_path):
    r = CliRunner().invoke(data_group, ["inspect", str(tmp_path / "nowhere")], prog_name="numbarl-data")
    _one_error(r, "no such folder")
    assert "meta.json" not in r.output


def test_a_failed_cache_build_leaves_no_lock_file(tmp_path, monkeypatch):
    from numbarl.config import DataConfig
    from numbarl.data import synth
    from numbarl.data.errors import DataError
    from numbarl.run import trainer

    def failing(path, *args, **kwargs):
        raise DataError("the build failed")

    monkeypatch.setattr(synth, "build_synthetic_cache", failing)
    with pytest.raises(DataError):
        trainer.prepare_data(DataConfig(cache_dir=str(tmp_path), synth_scale="tiny"), log=lambda m: None)
    assert _files(tmp_path) == []


def test_the_folders_the_readme_commands_write_are_git_ignored():
    """`numbarl-data synth --out data/synth` and `numbarl-train --out runs/...` (README) must not show
    up as untracked files in a clone."""
    repo = Path(__file__).resolve().parents[1]
    ignored = [line.strip() for line in (repo / ".gitignore").read_text().splitlines()]
    assert "/data/" in ignored and "/runs/" in ignored
    for path in ("data/synth/meta.json", "runs/first/config.json"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=repo)
        assert r.returncode in (0, 128), path  # 0: ignored (128: not a git checkout, e.g. an sdist)
