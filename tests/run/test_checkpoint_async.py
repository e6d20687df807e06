"""Background checkpoint writes (RunDir.save_checkpoint_async): the caller goes on while the writer
thread serializes, fsyncs and renames; what ends on disk is what a synchronous save writes; a write
that fails or a process killed mid-write leaves the previous checkpoint loadable and resumable; the
best pointer never names a checkpoint that is not on disk; and the time budget stays whole."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from numbarl.run import runio
from numbarl.run.progress import Progress
from numbarl.run.runio import RunDir, RunError


@pytest.fixture
def run(tmp_path):
    return RunDir.create(tmp_path / "run", {"train": {"seed": 0}})


@pytest.fixture
def rng():
    return np.random.default_rng(17)


def arrays_of(rng, k):
    return {"params/w": rng.standard_normal((5, 7)).astype(np.float32),
            "optim/m": rng.standard_normal(9),
            "env/cursor": rng.integers(0, 1000, 4).astype(np.int32),
            "agent/step": np.array([k], np.int64)}


def replay_of(rng, k):
    return {"replay/obs": rng.standard_normal((64, 3)).astype(np.float32) + k,
            "replay/count": np.array([k], np.int64)}


def same(got, want):
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name


class Gate:
    """Holds the writer thread at its n-th atomic write until released (a slow disk, on demand)."""

    def __init__(self, monkeypatch, n=1):
        self.entered, self.release, self.calls = threading.Event(), threading.Event(), 0
        real = runio.atomic_write

        def gated(path, write):
            if threading.current_thread() is not threading.main_thread():
                self.calls += 1
                if self.calls == n:
                    self.entered.set()
                    assert self.release.wait(10), "the test never released the writer"
            return real(path, write)

        monkeypatch.setattr(runio, "atomic_write", gated)


def test_background_write_is_complete_and_identical_to_a_synchronous_save(tmp_path, run, rng):
    arrays, replay, state = arrays_of(rng, 1), replay_of(rng, 1), {"step": 10, "history": [0.5, None]}
    sync = RunDir.create(tmp_path / "sync", {"train": {"seed": 0}})
    sync.save_checkpoint("e1", arrays, state, resume_arrays=replay)
    # the caller's buffer is a view: it changes right after the call, the file must not
    backing = np.arange(12, dtype=np.float64)
    view = {**arrays, "optim/v": backing[2:8]}
    run.save_checkpoint_async("e1", view, state, resume_arrays=replay)
    expected_v = backing[2:8].copy()
    backing[:] = -1.0
    state["history"].append(9.0)  # the state was serialized at the call
    assert run.wait_checkpoint() >= 0.0 and run.pending_checkpoint() is None
    got, got_state = RunDir.open(run.path).load_checkpoint("latest", require_resume=True)
    same(got, {**arrays, **replay, "optim/v": expected_v})
    assert got_state == {"step": 10, "history": [0.5, None]}
    want, want_state = sync.load_checkpoint("latest", require_resume=True)
    same({k: v for k, v in got.items() if k != "optim/v"}, want)
    assert got_state == want_state
    # the same files: checkpoint, sidecar, pointer, one resume file; the sidecar's manifest matches
    def names(r):
        return sorted(p.name.split(".")[0] + "".join(p.suffixes[-1:]) for p in r.checkpoints_dir.iterdir())

    assert names(run) == names(sync)
    assert run.checkpoint_writes["count"] == 1 and run.checkpoint_writes["bytes"] > 64 * 3 * 4
    assert runio.TEMP_MARKER not in "".join(os.listdir(run.checkpoints_dir))


def test_the_caller_goes_on_while_the_writer_writes_and_readers_wait(run, rng, monkeypatch):
    run.save_checkpoint("e1", arrays_of(rng, 1), {"step": 1}, resume_arrays=replay_of(rng, 1))
    gate = Gate(monkeypatch)
    new = arrays_of(rng, 2)
    t0 = time.perf_counter()
    run.save_checkpoint_async("e2", new, {"step": 2}, resume_arrays=replay_of(rng, 2), mark_best=("e2", 1.0))
    assert time.perf_counter() - t0 < 5.0 and gate.entered.wait(5)
    assert run.pending_checkpoint() == "e2"
    # another process sees the last committed state: latest and its replay are e1's, no best yet
    other = RunDir.open(run.path)
    assert other.latest_checkpoint()["tag"] == "e1" and other.best_checkpoint() is None
    assert other.load_checkpoint("latest", require_resume=True)[1] == {"step": 1}
    # e1 by name: read without waiting (its replay is not opened for a params-only read)
    assert run.load_checkpoint("e1", prefix="params/")[1] == {"step": 1} and run.pending_checkpoint() == "e2"
    # this process: a reader of the pointers waits for the write
    threading.Timer(0.2, gate.release.set).start()
    arrays, state = run.load_checkpoint("latest", require_resume=True)
    assert state == {"step": 2} and run.pending_checkpoint() is None
    same({k: v for k, v in arrays.items() if not k.startswith("replay/")}, new)
    assert run.best_checkpoint()["tag"] == "e2"
    assert run.checkpoint_writes["waited_s"] > 0.1
    assert [p.name.split(".")[0] for p in run.checkpoints_dir.glob("*.resume.npz")] == ["e2"]


@pytest.mark.parametrize("failing_replace", [1, 2, 3, 4, 5], ids=["resume", "npz", "sidecar", "latest", "best"])
def test_a_failing_background_write_keeps_the_previous_checkpoint_resumable(run, rng, monkeypatch, failing_replace):
    """The n-th commit (os.replace) of the writer thread fails: the error is raised by the next
    wait, nothing torn is left, the previous checkpoint loads with its replay, best.json never
    names a checkpoint that is not on disk, and the next save works."""
    previous, previous_replay = arrays_of(rng, 1), replay_of(rng, 1)
    run.save_checkpoint("e1", previous, {"step": 1}, resume_arrays=previous_replay)
    run.mark_best("e1", 0.5)
    real_replace, calls = os.replace, []

    def crashing_replace(src, dst):
        if threading.current_thread() is not threading.main_thread():
            calls.append(dst)
            if len(calls) == failing_replace:
                raise KeyboardInterrupt("killed while writing")  # as a signal would, mid-write
        return real_replace(src, dst)

    monkeypatch.setattr(runio.os, "replace", crashing_replace)
    run.save_checkpoint_async("e2", arrays_of(rng, 2), {"step": 2}, resume_arrays=replay_of(rng, 2),
                              mark_best=("e2", 2.0))
    with pytest.raises(KeyboardInterrupt, match="killed while writing"):
        run.wait_checkpoint()
    monkeypatch.setattr(runio.os, "replace", real_replace)
    assert run.wait_checkpoint() == 0.0  # raised once
    assert not [p for p in run.path.rglob("*") if runio.TEMP_MARKER in p.name]
    reopened = RunDir.open(run.path, clean=True)  # what --resume opens
    latest = reopened.latest_checkpoint()["tag"]
    assert latest == ("e2" if failing_replace == 5 else "e1")
    arrays, _ = reopened.load_checkpoint("latest", require_resume=True)
    if latest == "e1":
        same(arrays, {**previous, **previous_replay})
    best = reopened.best_checkpoint()["tag"]
    assert best == "e1" and (reopened.checkpoints_dir / f"{best}.npz").is_file()
    # the run goes on: the next background save commits
    run.save_checkpoint_async("e3", arrays_of(rng, 3), {"step": 3}, resume_arrays=replay_of(rng, 3),
                              mark_best=("e3", 3.0))
    run.wait_checkpoint()
    assert run.latest_checkpoint()["tag"] == "e3" and run.best_checkpoint()["tag"] == "e3"
    assert run.load_checkpoint("latest", require_resume=True)[1] == {"step": 3}


KILLED_WRITER = textwrap.dedent("""
    import sys, time, numpy as np
    from numbarl.run import runio
    run = runio.RunDir.open(sys.argv[1])
    real = runio.atomic_write
    def slow(path, write):  # the writer thread stops inside its write, after the temp file has data
        def partial(f):
            f.write(b"PK" + b"x" * 4096)
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
        return real(path, partial)
    runio.atomic_write = slow
    rng = np.random.default_rng(2)
    run.save_checkpoint_async("e2", {"params/w": rng.standard_normal(8)}, {"step": 2},
                              resume_arrays={"replay/obs": rng.standard_normal(64)}, mark_best=("e2", 9.0))
    time.sleep(60)
""")


def test_a_process_killed_during_a_background_write_resumes_from_the_previous_checkpoint(run, rng):
    previous, previous_replay = arrays_of(rng, 1), replay_of(rng, 1)
    run.save_checkpoint("e1", previous, {"step": 1}, resume_arrays=previous_replay)
    run.mark_best("e1", 0.5)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(run.path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
    torn = [p for p in run.checkpoints_dir.iterdir() if runio.TEMP_MARKER in p.name]
    assert torn  # the killed writer's half-written temp file
    reopened = RunDir.open(run.path, clean=True)  # --resume removes it
    assert not [p for p in run.checkpoints_dir.iterdir() if runio.TEMP_MARKER in p.name]
    arrays, state = reopened.load_checkpoint("latest", require_resume=True)
    same(arrays, {**previous, **previous_replay})
    assert state == {"step": 1} and reopened.best_checkpoint()["tag"] == "e1"
    assert [c["tag"] for c in reopened.list_checkpoints()] == ["e1"]


def test_one_write_at_a_time_in_order_and_a_summary_waits(run, rng, monkeypatch):
    gate = Gate(monkeypatch)
    run.save_checkpoint_async("e1", arrays_of(rng, 1), {"step": 1}, resume_arrays=replay_of(rng, 1))
    assert gate.entered.wait(5)
    threading.Timer(0.2, gate.release.set).start()
    run.save_checkpoint_async("e2", arrays_of(rng, 2), {"step": 2}, resume_arrays=replay_of(rng, 2))  # waits e1
    assert run.checkpoint_writes["count"] == 1 and run.checkpoint_writes["waited_s"] > 0.1
    run.write_summary({"folds": []})  # a summary never gets ahead of the checkpoints
    assert run.pending_checkpoint() is None and run.latest_checkpoint()["tag"] == "e2"
    assert [c["tag"] for c in run.list_checkpoints()] == ["e1", "e2"]
    with pytest.raises(ValueError, match="not valid"):  # checks run in the caller, at once
        run.save_checkpoint_async("../x", {"a": np.zeros(2)}, {"step": 1})
    with pytest.raises(RunError, match="not found"):
        run.load_checkpoint("e9")


def test_the_time_budget_counts_snapshots_and_waits_and_sums_to_the_total():
    now = [0.0]
    progress = Progress(quiet=True, clock=lambda: now[0])
    progress.charge("data", 1.0)
    progress.done("step", 10, 5.0)
    progress.charge("compile", 0.5)  # inside the step time
    progress.done("checkpoint", 1, 0.25)  # the snapshot
    progress.charge("checkpoint", 0.5)  # a wait for a background write
    progress.charge("report", 0.75)
    now[0] = 10.0
    budget = progress.time_budget()
    assert budget["checkpoint"] == 0.75 and budget["steps"] == 4.5 and budget["total"] == 10.0
    parts = [k for k in budget if k != "total"]
    assert sum(budget[k] for k in parts) == pytest.approx(budget["total"])
    assert budget["other"] == pytest.approx(10.0 - 1.0 - 0.5 - 4.5 - 0.75 - 0.75)
    resumed = progress.time_budget(previous=budget)  # a resumed run adds to the killed one's
    assert resumed["checkpoint"] == 1.5 and resumed["total"] == 20.0
    # the measured parts of `other`: a checkpoint wait inside a part counts under checkpoint only
    begun = progress.part_begin()
    now[0] += 2.0
    progress.charge("checkpoint", 0.5)
    progress.part_end("setup", begun)
    other = progress.time_other()
    assert other["setup"] == 1.5 and other["rest"] == pytest.approx(progress.time_budget()["other"] - 1.5, abs=1e-3)


def test_a_run_writes_its_checkpoints_in_the_background_complete_and_identical(tmp_path, monkeypatch):
    """A tiny run with a slow disk: the trainer hands each epoch's snapshot to the writer and goes
    on; after the run every checkpoint on disk is bitwise the snapshot it was given (the latest with
    its replay; the snapshot buffers are refilled by the next epoch's checkpoint), best.json names a saved checkpoint, train.log says when each one was on disk, and
    the time budget (waits under checkpoint) still sums to the total."""
    from click.testing import CliRunner

    from numbarl.cli import train_cmd

    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    handed = {}
    original = RunDir.save_checkpoint_async

    def recording(self, tag, arrays, state, latest=True, resume_arrays=None, mark_best=None, handed_over=False):
        handed[tag] = ({k: np.array(v, copy=True) for k, v in arrays.items()},
                       {k: np.array(v, copy=True) for k, v in (resume_arrays or {}).items()})
        return original(self, tag, arrays, state, latest=latest, resume_arrays=resume_arrays, mark_best=mark_best,
                        handed_over=handed_over)

    real_write, real_wait = runio.atomic_write, RunDir.wait_checkpoint
    disk_done = threading.Event()

    def slow_disk(path, write):  # the last replay file is on disk 0.3 s after the run first waits for it
        if str(path).endswith(runio.RESUME_SUFFIX) and "epoch0002" in str(path):
            assert disk_done.wait(30)
        return real_write(path, write)

    def wait(self, tag=None):
        if (self.pending_checkpoint() == "fold0-epoch0002" and tag in (None, "fold0-epoch0002")
                and threading.current_thread() is threading.main_thread() and not disk_done.is_set()):
            threading.Timer(0.3, disk_done.set).start()
        return real_wait(self, tag)

    monkeypatch.setattr(RunDir, "save_checkpoint_async", recording)
    monkeypatch.setattr(runio, "atomic_write", slow_disk)
    monkeypatch.setattr(RunDir, "wait_checkpoint", wait)
    out = tmp_path / "run"
    r = CliRunner().invoke(train_cmd, ["--preset", "tiny", "--quiet", "--set", "data.synth_bars_per_day=30",
                                       "--set", "train.collect_steps_per_epoch=4", "--set", "train.log_interval=2",
                                       "--set", "train.learning_starts=3", "--out", str(out)], catch_exceptions=True)
    assert r.exit_code == 0, r.output + repr(r.exception)
    run = RunDir.open(out)
    assert sorted(handed) == ["fold0-epoch0001", "fold0-epoch0002"] and run.pending_checkpoint() is None
    for tag, (arrays, replay) in handed.items():
        got, _ = run.load_checkpoint(tag)
        same(got, {**arrays, **(replay if tag == "fold0-epoch0002" else {})})  # only the latest keeps its replay
    assert replay and run.latest_checkpoint()["tag"] == "fold0-epoch0002"
    assert run.best_checkpoint()["tag"] in handed
    log = (out / "train.log").read_text()
    for tag in handed:
        assert f"checkpoint {tag} (writing)" in log and f"checkpoint {tag} on disk" in log
    summary = run.read_summary()
    budget, writes = summary["time_budget_s"], summary["checkpoint_writes"]
    parts = [k for k in budget if k != "total"]
    assert sum(budget[k] for k in parts) == pytest.approx(budget["total"], abs=0.01)
    assert writes["count"] == 2 and writes["write_s"] >= 0.3
    assert budget["checkpoint"] >= writes["waited_s"] > 0.1  # the slow write was waited for, and counted
    assert sum(summary["time_other_s"].values()) == pytest.approx(budget["other"], abs=0.01)


def test_snapshot_buffers_are_refilled_only_after_their_write(run):
    """The trainer's checkpoint snapshots (FoldTrainer.save): Arena.to_host inside pinned_snapshots
    copies into the pool's buffers, the same ones at every checkpoint, handed to the writer thread
    without a copy; each is refilled only after the write that reads it, so every checkpoint on
    disk holds its own epoch's values."""
    from numbarl.cuda.runtime import Arena, pinned_snapshots

    arena = Arena("snapshot-test")
    arena.add("x", (1000,), np.float32)
    arena.add("n", (3,), np.int64)
    arena.allocate()
    pool, first = {}, None
    for k in range(3):
        arena.load({"x": np.full(1000, k, np.float32), "n": np.arange(3) + k})
        run.wait_checkpoint()  # FoldTrainer.save waits before it refills
        with pinned_snapshots(pool):
            arrays = arena.to_host()
        first = first or arrays
        assert all(arrays[name] is first[name] for name in arrays)  # refilled, not made again
        run.save_checkpoint_async(f"e{k}", arrays, {"k": k}, resume_arrays={}, handed_over=True)
    for k in range(3):
        arrays, state = run.load_checkpoint(f"e{k}")
        assert state["k"] == k and (arrays["x"] == k).all() and (arrays["n"] == np.arange(3) + k).all()
    assert arena.to_host()["x"] is not first["x"]  # outside a block: fresh arrays, as before
