"""Run folder: create/open, metrics log and CSV, atomic checkpoints, trades, equity, summary."""

import contextlib
import json
import os

import numpy as np
import pandas as pd
import pytest

from numbarl.run import runio
from numbarl.run.runio import RunDir, RunError


def strict_json(text: str):
    """json.loads that fails on NaN/Infinity (which the stdlib accepts by default)."""

    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=reject)


def temp_files(folder):
    return [p for p in folder.rglob("*") if runio.TEMP_MARKER in p.name]


@pytest.fixture
def run(tmp_path):
    return RunDir.create(tmp_path / "run", {"train": {"lr": 3e-4, "epochs": 2}}, {"seed": 3})


# ----------------------------------------------------------------------------------------------
# create / open
# ----------------------------------------------------------------------------------------------


def test_create_writes_config_and_marker_and_open_reads_them(tmp_path):
    config = {"env": {"fee": 0.25, "sizes": (0.25, 0.5, 1.0)}, "seed": np.int64(11), "gamma": np.float32(0.5)}
    created = RunDir.create(tmp_path / "a" / "run", config, {"device": "test", "bad": float("nan")})
    assert strict_json((created.path / "config.json").read_text()) == {
        "env": {"fee": 0.25, "sizes": [0.25, 0.5, 1.0]},
        "seed": 11,
        "gamma": 0.5,
    }
    opened = RunDir.open(created.path)
    assert opened.config == created.config
    assert opened.meta["device"] == "test" and opened.meta["bad"] is None
    assert opened.meta["format_version"] == runio.RUN_FORMAT_VERSION
    assert (opened.path / "checkpoints").is_dir()


def test_create_refuses_a_non_empty_folder_unless_exist_ok(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    RunDir.create(folder, {"a": 1})  # an existing empty folder is fine
    with pytest.raises(RunError, match="already exists and is not empty"):
        RunDir.create(folder, {"a": 2})
    RunDir.create(folder, {"a": 2}, exist_ok=True)
    assert RunDir.open(folder).config == {"a": 2}
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunError, match="a file with that name exists"):
        RunDir.create(tmp_path / "file", {"a": 1})


def test_a_kill_while_creating_leaves_no_run_folder(tmp_path, monkeypatch):
    """Killed between config.json and run.json: no half-made folder under the --out name (it
    could neither be resumed nor reused), and no temp folder either."""
    calls = []
    real = runio.atomic_write

    def dies_on_the_marker(path, write):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(path, write)

    monkeypatch.setattr(runio, "atomic_write", dies_on_the_marker)
    with pytest.raises(KeyboardInterrupt):
        RunDir.create(tmp_path / "run", {"a": 1})
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    # a hard kill (no cleanup) leaves a temp folder: the next creation removes it if its process
    # is gone, and leaves a live process's alone
    dead = tmp_path / f".run{runio.TEMP_MARKER}999999999-deadbeef"
    live = tmp_path / f".run{runio.TEMP_MARKER}{os.getpid()}-cafecafe"
    for folder in (dead, live):
        (folder / "checkpoints").mkdir(parents=True)
    assert RunDir.open(RunDir.create(tmp_path / "run", {"a": 1}).path).config == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "run"])


def test_open_something_that_is_not_a_run_names_the_path_and_what_is_missing(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(RunError, match="does not exist") as info:
        RunDir.open(missing)
    assert str(missing) in str(info.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RunError) as info:
        RunDir.open(empty)
    message = str(info.value)
    assert str(empty) in message and "not a numbarl run folder" in message
    assert "run.json" in message and "config.json" in message

    only_config = tmp_path / "only_config"
    only_config.mkdir()
    (only_config / "config.json").write_text("{}")
    with pytest.raises(RunError, match="run.json missing"):
        RunDir.open(only_config)

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    (foreign / "run.json").write_text('{"format": "something-else"}')
    with pytest.raises(RunError, match="has no format"):
        RunDir.open(foreign)

    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(RunError, match="is a file"):
        RunDir.open(a_file)


def test_open_refuses_a_newer_format_and_a_corrupt_marker(run):
    marker = json.loads((run.path / "run.json").read_text())
    marker["format_version"] = runio.RUN_FORMAT_VERSION + 1
    (run.path / "run.json").write_text(json.dumps(marker))
    with pytest.raises(RunError, match="upgrade numbarl"):
        RunDir.open(run.path)
    (run.path / "run.json").write_text('{"format": "numbarl-r')
    with pytest.raises(RunError, match="cannot be read"):
        RunDir.open(run.path)


# ----------------------------------------------------------------------------------------------
# metrics log
# ----------------------------------------------------------------------------------------------


def test_log_writes_strict_json_with_null_for_non_finite(run):
    written = run.log(
        {
            "kind": "train",
            "step": np.int64(10),
            "loss": float("nan"),
            "q_mean": np.float32(0.25),
            "grad_norm": float("inf"),
            "per_branch": np.array([1.5, -np.inf], dtype=np.float32),
            "flags": {"finite": np.bool_(False), "worst": -np.inf},
        }
    )
    line = (run.path / "metrics.jsonl").read_text()
    assert line.endswith("\n") and line.count("\n") == 1
    record = strict_json(line)
    assert record == written
    assert record == {
        "kind": "train",
        "step": 10,
        "loss": None,
        "q_mean": 0.25,
        "grad_norm": None,
        "per_branch": [1.5, None],
        "flags": {"finite": False, "worst": None},
    }


def test_log_rejects_records_without_a_known_kind(run):
    with pytest.raises(ValueError, match="kind"):
        run.log({"step": 1, "loss": 0.5})
    with pytest.raises(ValueError, match="kind"):
        run.log({"kind": "epoch", "step": 1})
    with pytest.raises(TypeError):
        run.log([("kind", "train")])
    assert run.read_metrics() == []


def test_write_csv_has_the_union_of_columns(run, rng):
    losses = rng.normal(size=3)
    run.log({"kind": "train", "fold": 0, "epoch": 0, "step": 10, "loss": losses[0], "epsilon": 0.9})
    run.log(
        {"kind": "train", "fold": 0, "epoch": 0, "step": 20, "loss": losses[1], "epsilon": 0.8, "q_mean": 0.1}
    )
    run.log({"kind": "val", "fold": 0, "epoch": 0, "step": 20, "sharpe": losses[2], "detail": {"trades": 7}})
    run.log({"epsilon": 0.7, "step": 30, "kind": "train", "fold": 0, "epoch": 1, "loss": float("nan")})
    path = run.write_csv()
    frame = pd.read_csv(path)
    assert list(frame.columns[:4]) == ["kind", "fold", "epoch", "step"]
    assert set(frame.columns) == {
        "kind",
        "fold",
        "epoch",
        "step",
        "loss",
        "epsilon",
        "q_mean",
        "sharpe",
        "detail.trades",
    }
    assert list(frame["kind"]) == ["train", "train", "val", "train"]
    np.testing.assert_allclose(frame["loss"].to_numpy()[:2], losses[:2], rtol=1e-15)
    assert frame["loss"].isna().tolist() == [False, False, True, True]  # absent and NaN both empty
    assert frame["q_mean"].isna().tolist() == [True, False, True, True]
    assert frame["detail.trades"].iloc[2] == 7
    assert frame["sharpe"].iloc[2] == pytest.approx(losses[2], rel=1e-15)


def uninterrupted_log(run, steps, fold=0):
    for step in steps:
        run.log({"kind": "train", "fold": fold, "step": step, "loss": 1.0 / step})
        if step % 50 == 0:
            run.log({"kind": "val", "fold": fold, "step": step, "sharpe": step / 100})


def test_truncate_log_makes_a_resumed_log_equal_an_uninterrupted_one(tmp_path):
    steps = list(range(10, 201, 10))
    reference = RunDir.create(tmp_path / "reference", {"a": 1})
    uninterrupted_log(reference, steps)

    killed = RunDir.create(tmp_path / "killed", {"a": 1})
    uninterrupted_log(killed, steps[:13])  # killed at step 130; last checkpoint at step 100
    with open(killed.metrics_path, "a") as f:
        f.write('{"kind": "train", "step": 14')  # and killed in the middle of a write
    killed.write_csv()
    dropped = killed.truncate_log(after_step=100)
    assert dropped == 3  # steps 110, 120, 130; the partial line is not a record
    kept = killed.read_metrics()
    assert max(r["step"] for r in kept) == 100 and kept[-1] == {
        "kind": "val",
        "fold": 0,
        "step": 100,
        "sharpe": 1.0,
    }
    assert len(pd.read_csv(killed.csv_path)) == len(kept)  # csv rebuilt with the log

    uninterrupted_log(killed, steps[10:])  # the resumed run continues after step 100
    assert killed.metrics_path.read_bytes() == reference.metrics_path.read_bytes()


def test_truncate_log_with_a_step_counter_that_restarts_per_fold(run):
    uninterrupted_log(run, [10, 20, 30], fold=0)
    uninterrupted_log(run, [10, 20, 30], fold=1)
    assert run.truncate_log(after_step=10, fold=1) == 2
    assert [(r["fold"], r["step"]) for r in run.read_metrics()] == [(0, 10), (0, 20), (0, 30), (1, 10)]
    assert run.truncate_log(after_step=20, fold=0) == 2
    assert [(r["fold"], r["step"]) for r in run.read_metrics()] == [(0, 10), (0, 20)]
    assert run.truncate_log(after_step=20, fold=0) == 0


def test_a_partial_last_line_is_skipped_and_repaired_by_the_next_log(run):
    run.log({"kind": "train", "step": 1, "loss": 0.5})
    with open(run.metrics_path, "a") as f:
        f.write('{"kind": "train", "st')
    assert [r["step"] for r in run.read_metrics()] == [1]
    run.log({"kind": "train", "step": 2, "loss": 0.25})
    lines = run.metrics_path.read_text().splitlines()
    assert [strict_json(line)["step"] for line in lines] == [1, 2]


def test_a_corrupt_line_in_the_middle_is_an_error(run):
    run.log({"kind": "train", "step": 1})
    with open(run.metrics_path, "a") as f:
        f.write("garbage\n")
    run.log({"kind": "train", "step": 2})
    with pytest.raises(RunError, match="line 2"):
        run.read_metrics()


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------


def random_arrays(rng):
    n = int(rng.integers(50, 300))
    return {
        "params": rng.normal(size=n).astype(np.float32),
        "adam.m": rng.normal(size=(3, 7)).astype(np.float32),
        "rng_counter": rng.integers(0, 2**62, size=1, dtype=np.int64),
        "env.cursor": rng.integers(0, 10_000, size=13).astype(np.int32),
        "mask": rng.random(5) > 0.5,
        "scalar": np.float64(rng.normal()),
    }


def assert_same_arrays(got, expected):
    assert set(got) == set(expected)
    for name, value in expected.items():
        value = np.asarray(value)
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name  # bitwise, NaN payloads included


def test_checkpoint_round_trip_is_bitwise(run, rng):
    arrays = random_arrays(rng)
    arrays["params"][3] = np.nan  # a NaN weight survives as the same bits
    state = {
        "step": 1200,
        "fold": 1,
        "epoch": 3,
        "epsilon": np.float32(0.125),
        "best": float("inf"),
        "opt": {"beta1": 0.9, "t": np.int64(1200)},
    }
    path = run.save_checkpoint("f1-e003", arrays, state)
    assert path == run.path / "checkpoints" / "f1-e003.npz"
    for tag in ("latest", "f1-e003"):
        got, got_state = run.load_checkpoint(tag)
        assert_same_arrays(got, arrays)
        assert np.isnan(got["params"][3])
        assert got_state == {
            "step": 1200,
            "fold": 1,
            "epoch": 3,
            "epsilon": 0.125,
            "best": None,
            "opt": {"beta1": 0.9, "t": 1200},
        }
    sidecar = strict_json((run.checkpoints_dir / "f1-e003.json").read_text())
    assert sidecar["arrays"]["params"] == {"shape": [len(arrays["params"])], "dtype": "<f4"}
    assert strict_json((run.checkpoints_dir / "latest.json").read_text())["tag"] == "f1-e003"
    reopened = RunDir.open(run.path)
    assert_same_arrays(reopened.load_checkpoint()[0], arrays)


def test_checkpoint_names_are_checked(run):
    for tag in ("latest", "best", "", "../x", "a/b", ".hidden", "x" * 200):
        with pytest.raises(ValueError):
            run.save_checkpoint(tag, {"a": np.zeros(2)}, {"step": 1})
    with pytest.raises(ValueError, match="__state__"):
        run.save_checkpoint("ok", {"__state__": np.zeros(2)}, {"step": 1})
    with pytest.raises(TypeError, match="object"):
        run.save_checkpoint("ok", {"a": np.array([None, 1], dtype=object)}, {"step": 1})
    with pytest.raises(RunError, match="no latest checkpoint"):
        run.load_checkpoint()
    for tag in ("../x", "a/b"):  # a user's --checkpoint value: an input error (exit 2), not a traceback
        with pytest.raises(RunError, match="is not valid"):
            run.load_checkpoint(tag)
    run.save_checkpoint("ok", {"a": np.zeros(2)}, {"step": 1})
    with pytest.raises(RunError, match="not found.*saved: ok"):
        run.load_checkpoint("missing")


@contextlib.contextmanager
def crash_at_replace(monkeypatch, n: int):
    """The n-th os.replace of the block raises (os.replace is the commit point of each file)."""
    real_replace = os.replace
    calls = []

    def crashing_replace(src, dst):
        calls.append(dst)
        if len(calls) == n:
            raise OSError("simulated crash")
        return real_replace(src, dst)

    monkeypatch.setattr(runio.os, "replace", crashing_replace)
    with pytest.raises(OSError, match="simulated crash"):
        yield
    monkeypatch.setattr(runio.os, "replace", real_replace)


@pytest.mark.parametrize("failing_replace", [1, 2, 3], ids=["npz", "sidecar", "latest"])
def test_a_crash_during_save_keeps_the_previous_checkpoint(run, rng, monkeypatch, failing_replace):
    """os.replace is the commit point of each file; make the n-th one of a save fail."""
    previous = random_arrays(rng)
    run.save_checkpoint("e1", previous, {"step": 100})
    with crash_at_replace(monkeypatch, failing_replace):
        run.save_checkpoint("e2", random_arrays(rng), {"step": 200})

    assert temp_files(run.path) == []
    reopened = RunDir.open(run.path)
    arrays, state = reopened.load_checkpoint("latest")
    assert_same_arrays(arrays, previous)
    assert state == {"step": 100}
    # an .npz committed without its sidecar is complete on its own and is listed from itself
    listed = {c["tag"]: c["step"] for c in reopened.list_checkpoints()}
    assert listed == ({"e1": 100} if failing_replace == 1 else {"e1": 100, "e2": 200})


def test_a_crash_while_overwriting_the_same_tag_keeps_the_old_content(run, rng, monkeypatch):
    old = random_arrays(rng)
    run.save_checkpoint("last", old, {"step": 1})

    def crashing_replace(src, dst):
        raise KeyboardInterrupt  # e.g. Ctrl-C between the temp write and the rename

    monkeypatch.setattr(runio.os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        run.save_checkpoint("last", random_arrays(rng), {"step": 2})
    monkeypatch.undo()
    arrays, state = run.load_checkpoint("last")
    assert_same_arrays(arrays, old)
    assert state == {"step": 1}
    assert temp_files(run.path) == []


def test_a_sidecar_from_an_older_save_is_not_trusted(run, rng):
    run.save_checkpoint("last", random_arrays(rng), {"step": 1})
    stale_sidecar = (run.checkpoints_dir / "last.json").read_bytes()
    new = random_arrays(rng)
    run.save_checkpoint("last", new, {"step": 2})
    (run.checkpoints_dir / "last.json").write_bytes(stale_sidecar)  # as if killed before the sidecar
    assert [(c["tag"], c["step"]) for c in run.list_checkpoints()] == [("last", 2)]
    arrays, state = run.load_checkpoint("last")
    assert_same_arrays(arrays, new)
    assert state == {"step": 2}


def test_resume_open_removes_temp_files_left_by_a_killed_writer(run):
    run.save_checkpoint("e1", {"a": np.arange(3)}, {"step": 1})
    torn = run.checkpoints_dir / f".e2.npz{runio.TEMP_MARKER}999-deadbeef"
    torn.write_bytes(b"PK\x03\x04 half a zip")
    stray = run.path / f".summary.json{runio.TEMP_MARKER}999-cafe0000"
    stray.write_text("{")
    RunDir.open(run.path)  # a reader (numbarl-compare, -backtest): a live writer may own them
    assert torn.exists() and stray.exists()
    reopened = RunDir.open(run.path, clean=True)  # the resuming writer
    assert not torn.exists() and not stray.exists()
    assert [c["tag"] for c in reopened.list_checkpoints()] == ["e1"]
    assert np.array_equal(reopened.load_checkpoint()[0]["a"], np.arange(3))


def test_mark_best_tracks_the_best_score(run):
    for epoch in range(4):
        run.save_checkpoint(f"e{epoch}", {"w": np.full(3, epoch, dtype=np.float32)}, {"step": epoch})
    assert run.best_checkpoint() is None
    assert run.mark_best("e0", 0.5)
    assert run.mark_best("e1", 1.5)
    assert not run.mark_best("e2", 1.5)  # ties keep the earlier checkpoint
    assert not run.mark_best("e2", float("nan"))
    assert not run.mark_best("e3", -2.0)
    assert run.best_checkpoint()["tag"] == "e1" and run.best_checkpoint()["score"] == 1.5
    arrays, state = run.load_checkpoint("best")
    assert np.array_equal(arrays["w"], np.full(3, 1, dtype=np.float32)) and state == {"step": 1}
    assert run.load_checkpoint("latest")[1] == {"step": 3}
    with pytest.raises(RunError, match="was not saved"):
        run.mark_best("e9", 10.0)
    run.reset_best()
    assert run.best_checkpoint() is None
    assert run.mark_best("e3", 0.2, higher_is_better=False)
    assert run.mark_best("e2", 0.1, higher_is_better=False)
    assert not run.mark_best("e0", 0.3, higher_is_better=False)
    assert run.best_checkpoint()["tag"] == "e2"


def test_list_and_prune_checkpoints_keep_latest_and_best(run):
    for epoch in range(5):
        run.save_checkpoint(f"e{epoch}", {"w": np.zeros(2)}, {"step": 10 * epoch})
    run.mark_best("e1", 3.0)
    assert [(c["tag"], c["step"]) for c in run.list_checkpoints()] == [(f"e{i}", 10 * i) for i in range(5)]
    assert run.prune_checkpoints(keep_last=2) == ["e0", "e2"]
    assert [c["tag"] for c in run.list_checkpoints()] == ["e1", "e3", "e4"]
    assert run.load_checkpoint("best")[1] == {"step": 10}
    assert run.prune_checkpoints(keep_last=0) == ["e3"]  # e4 is latest, e1 is best
    assert [c["tag"] for c in run.list_checkpoints()] == ["e1", "e4"]


# ----------------------------------------------------------------------------------------------
# trades, equity, summary
# ----------------------------------------------------------------------------------------------


def test_write_trades_per_fold_replaces_that_fold_only(run, rng):
    def trades(n):
        return pd.DataFrame(
            {
                "entry_bar": rng.integers(0, 1000, n),
                "direction": rng.choice([-1, 1], n),
                "pnl": rng.normal(size=n),
            }
        )

    fold0, fold1, fold1_rerun = trades(4), trades(3), trades(5)
    run.write_trades("test", fold1, fold=1)
    run.write_trades("test", fold0, fold=0)
    run.write_trades("test", fold1_rerun, fold=1)  # fold 1 re-run after a resume
    got = run.read_trades("test")
    assert list(got.columns) == ["fold", "entry_bar", "direction", "pnl"]
    assert got["fold"].tolist() == [0] * 4 + [1] * 5
    np.testing.assert_allclose(got["pnl"].to_numpy(), np.r_[fold0["pnl"], fold1_rerun["pnl"]], rtol=1e-15)
    assert run.trade_splits() == ["test"]
    assert run.read_trades("val") is None

    run.write_trades("val", pd.DataFrame(columns=["entry_bar", "pnl"]))
    assert len(run.read_trades("val")) == 0
    with pytest.raises(ValueError, match="split name"):
        run.write_trades("../x", fold0)


def test_write_equity_round_trip_and_checks(run, rng):
    n = 37
    pnl = rng.normal(size=n)
    position = rng.choice([-1.0, 0.0, 1.0], n)
    stamps = np.arange(n, dtype=np.int64) * 60_000_000_000
    run.write_equity("test", 1, {"pnl": pnl, "position": position, "timestamps": stamps})
    run.write_equity("val", 0, {"equity": np.array([1.0, 3.0, 2.5])})
    saved = run.read_equity()
    assert list(saved) == [("test", 1), ("val", 0)]
    np.testing.assert_array_equal(saved[("test", 1)]["pnl"], pnl)
    np.testing.assert_allclose(saved[("test", 1)]["equity"], np.cumsum(pnl), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(saved[("test", 1)]["position"], position)
    assert saved[("test", 1)]["timestamps"].dtype == np.int64
    np.testing.assert_array_equal(saved[("val", 0)]["pnl"], [1.0, 2.0, -0.5])  # hand-computed diff
    assert list(run.read_equity("val")) == [("val", 0)]
    with pytest.raises(ValueError, match="differ in length"):
        run.write_equity("test", 0, {"pnl": pnl, "position": position[:-1]})
    with pytest.raises(ValueError, match="needs 'pnl' or 'equity'"):
        run.write_equity("test", 0, {"position": position})
    with pytest.raises(ValueError, match="1-D"):
        run.write_equity("test", 0, {"pnl": pnl.reshape(1, -1)})


def test_write_summary_is_strict_json(run, monkeypatch):
    summary = {"folds": [{"fold": 0, "test": {"sharpe": float("nan"), "trades": np.int64(4)}}], "seed": 1}
    run.write_summary(summary)
    assert strict_json(run.summary_path.read_text()) == {
        "folds": [{"fold": 0, "test": {"sharpe": None, "trades": 4}}],
        "seed": 1,
    }
    assert run.read_summary()["seed"] == 1

    def crashing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(runio.os, "replace", crashing_replace)
    with pytest.raises(OSError):
        run.write_summary({"seed": 2})
    monkeypatch.undo()
    assert run.read_summary()["seed"] == 1  # the previous summary is intact
    assert temp_files(run.path) == []


def _replay(rng, k):
    return {"replay/obs": rng.standard_normal((8, 3)).astype(np.float32) + k, "replay/count": np.array([k], np.int64)}


def test_only_the_latest_checkpoint_keeps_its_resume_arrays(run, rng):
    """The replay buffer goes to a resume file that only the latest checkpoint keeps."""
    saved = {}
    for epoch in (1, 2, 3):
        saved[epoch] = (random_arrays(rng), _replay(rng, epoch))
        run.save_checkpoint(f"e{epoch}", saved[epoch][0], {"step": epoch}, resume_arrays=saved[epoch][1])
    files = sorted(p.name for p in run.checkpoints_dir.glob("*.resume.npz"))
    assert len(files) == 1 and files[0].startswith("e3.")
    assert [c["tag"] for c in run.list_checkpoints()] == ["e1", "e2", "e3"]
    arrays, _ = RunDir.open(run.path).load_checkpoint("latest", require_resume=True)
    assert_same_arrays(arrays, {**saved[3][0], **saved[3][1]})
    old, _ = run.load_checkpoint("e1")  # params etc. still load; the replay is gone
    assert_same_arrays(old, saved[1][0])
    with pytest.raises(RunError, match="e1.*missing"):
        run.load_checkpoint("e1", require_resume=True)
    params_only, _ = run.load_checkpoint("latest", prefix="params")
    assert set(params_only) == {"params"}
    # pruning removes a pruned checkpoint's resume file with it; the latest keeps its own
    run.save_checkpoint("e4", random_arrays(rng), {"step": 4}, resume_arrays=_replay(rng, 4), latest=False)
    run.prune_checkpoints(keep_last=0)
    assert [c["tag"] for c in run.list_checkpoints()] == ["e3"]
    assert sorted(p.name for p in run.checkpoints_dir.glob("*.resume.npz")) == files
    with pytest.raises(ValueError, match="resume"):
        run.save_checkpoint("x.resume", {"a": np.zeros(2)}, {"step": 1})


@pytest.mark.parametrize("failing_replace", [1, 2, 3, 4], ids=["resume", "npz", "sidecar", "latest"])
def test_a_crash_during_save_keeps_the_previous_checkpoint_resumable(run, rng, monkeypatch, failing_replace):
    previous, previous_replay = random_arrays(rng), _replay(rng, 1)
    run.save_checkpoint("e1", previous, {"step": 100}, resume_arrays=previous_replay)
    with crash_at_replace(monkeypatch, failing_replace):
        run.save_checkpoint("e2", random_arrays(rng), {"step": 200}, resume_arrays=_replay(rng, 2))
    arrays, state = RunDir.open(run.path).load_checkpoint("latest", require_resume=True)
    assert_same_arrays(arrays, {**previous, **previous_replay})
    assert state == {"step": 100}
