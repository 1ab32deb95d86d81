"""Every view of a run reads one truth from its directory (issue 42, point 6): a half-deleted,
copied or crashed run reads the same in ``ls`` and ``status``, shown as what it is (damaged,
with what it lacks), with the checkpoints on its own disk, named relative to it. Each test
damages a copy of the session's finished run (``fast_run``) as a user would, then reads it
as the commands do."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import FAST_RUN_STEPS, read_events

from gpu_console.commands import status as status_cmd
from gpu_console.commands.runs import json_row, list_runs, ls_main
from gpu_console.fold import RunFold
from gpu_console.runs import STATUS, find_run

LATEST = f"step-{FAST_RUN_STEPS:08d}"


def views(run, capsys):
    """(the run's ``ls --json`` entry, its ``status --json``, its ``status`` text)."""
    (row,) = [json_row(r) for r in list_runs(run.parent) if r["path"] == str(run)]
    shown = status_cmd.to_json(*status_cmd.status(str(run), run.parent))
    capsys.readouterr()
    status_cmd.main(str(run), run.parent, as_json=False)
    return row, shown, capsys.readouterr().out


def lines_of(text):
    return dict(line.split(": ", 1) for line in text.splitlines()[1:] if ": " in line)


def test_a_run_without_run_toml_is_shown_damaged_by_ls_and_status(fast_run, tmp_path, capsys):
    run = fast_run.copy(tmp_path / "runs")
    (run / "run.toml").unlink()
    assert find_run(run.name, run.parent) == run  # not "no such run"
    row, shown, text = views(run, capsys)
    assert row["damaged"] == shown["damaged"] == ["run.toml is missing"]
    assert row["state"] == shown["state"] == "finished"
    assert row["step"] == shown["step"] == FAST_RUN_STEPS
    assert lines_of(text)["damaged"] == "run.toml is missing"
    ls_main(run.parent, as_json=False)
    table = capsys.readouterr().out
    assert f"{run.name}: damaged: run.toml is missing" in table.splitlines()


def test_a_run_without_events_shows_the_same_step_in_ls_and_status(fast_run, tmp_path, capsys):
    run = fast_run.copy(tmp_path / "runs")
    loss = json.loads((run / STATUS).read_text())["loss"]
    (run / "events.jsonl").unlink()
    row, shown, text = views(run, capsys)
    figures = ("state", "step", "max_steps", "loss")
    assert [row[k] for k in figures] == [shown[k] for k in figures]
    assert (shown["step"], shown["max_steps"], shown["loss"]) == (
        FAST_RUN_STEPS, FAST_RUN_STEPS, loss
    )  # fmt: skip
    assert lines_of(text)["steps"] == f"{FAST_RUN_STEPS}/{FAST_RUN_STEPS}"
    assert row["damaged"] == shown["damaged"] == ["events.jsonl is missing"]


def test_status_names_no_checkpoint_that_is_not_on_disk(fast_run, tmp_path, capsys):
    run = fast_run.copy(tmp_path / "runs")
    shutil.rmtree(run / "checkpoints")
    row, shown, text = views(run, capsys)
    assert shown["checkpoint"] is None
    assert lines_of(text)["checkpoint"] == f"none on disk (checkpoints/{LATEST} is gone)"
    assert row["damaged"] == shown["damaged"] == ["checkpoints/ is missing"]


def test_a_copied_run_names_its_own_checkpoints_relative_to_it(
    fast_run, tmp_path, capsys, monkeypatch
):
    (tmp_path / "other").mkdir()
    run = tmp_path / "other" / fast_run.run.name
    shutil.copytree(fast_run.run, run, symlinks=True)  # cp -r RUN other/
    monkeypatch.chdir(tmp_path)  # the run named relative to this shell: paths still its own
    relative = f"other/{run.name}"
    shown = status_cmd.to_json(*status_cmd.status(relative, tmp_path / "runs"))
    assert shown["checkpoint"]["path"] == str(run / "checkpoints" / LATEST)
    capsys.readouterr()
    status_cmd.main(relative, tmp_path / "runs", as_json=False)
    text = capsys.readouterr().out
    assert lines_of(text)["checkpoint"].startswith(f"checkpoints/{LATEST} (step {FAST_RUN_STEPS}")
    assert str(fast_run.run) not in text


def test_ls_after_a_resumed_session_failed_before_its_first_step(fast_run, tmp_path):
    run = fast_run.copy(tmp_path / "runs")
    before = json.loads((run / STATUS).read_text())
    # A resume from the end checkpoint (max_steps raised) whose engine failed at once: its
    # session in meta.json, the last status.json in history/ (launch.continue_run), and one
    # failed status event; its supervisor died before it could record the end.
    meta = json.loads((run / "meta.json").read_text())
    meta["sessions"].append(
        {
            "started": before["ended"] + 1,
            "events_from": (run / "events.jsonl").stat().st_size,
            "resume_from": str(fast_run.run / "checkpoints" / LATEST),
        }
    )
    (run / "meta.json").write_text(json.dumps(meta))
    (run / "history").mkdir()
    (run / STATUS).rename(run / "history" / "status-1.json")
    failed = {"v": 1, "t": before["ended"] + 2, "kind": "status", "state": "failed"}
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps(failed | {"reason": "build_model() failed"}) + "\n")
    (row,) = list_runs(run.parent)
    assert row["state"] == "failed"
    assert (row["step"], row["loss"]) == (FAST_RUN_STEPS, before["loss"])


def test_a_resumed_session_carries_the_runs_step_until_its_engine_speaks():
    fold = RunFold()
    fold.carry({"step": 20, "loss": 0.5, "max_steps": 20}, resume_step=16)
    assert {k: fold.to_status()[k] for k in ("step", "loss", "max_steps")} == {
        "step": 16, "loss": 0.5, "max_steps": 20
    }  # fmt: skip
    fold.apply({"kind": "status", "t": 1.0, "state": "failed"})
    assert (fold.to_status()["step"], fold.to_status()["loss"]) == (16, 0.5)
    fold.apply({"kind": "start", "t": 2.0, "start_step": 16, "max_steps": 40})
    fold.apply({"kind": "step", "t": 3.0, "step": 17, "loss": 0.4})
    assert (fold.step, fold.loss, fold.max_steps) == (17, 0.4, 40)


@pytest.mark.parametrize("event", ["older", "none"])
def test_after_a_crash_status_names_the_newest_complete_checkpoint(
    fast_run, tmp_path, capsys, event
):
    run = fast_run.copy(tmp_path / "runs")
    ckpts = run / "checkpoints"
    older = f"step-{FAST_RUN_STEPS // 2:08d}"
    shutil.copytree(ckpts / LATEST, ckpts / older)
    meta = json.loads((ckpts / older / "meta.json").read_text())
    (ckpts / older / "meta.json").write_text(json.dumps(meta | {"step": FAST_RUN_STEPS // 2}))
    # The crash came after LATEST moved to the newest checkpoint and before its event: the
    # events know the older one, or none.
    kept = []
    for e in read_events(run):
        if e.get("kind") == "checkpoint":
            if event == "none":
                continue
            e = e | {"step": FAST_RUN_STEPS // 2, "path": str(ckpts / older)}
        kept.append(json.dumps(e))
    (run / "events.jsonl").write_text("\n".join(kept) + "\n")
    _, shown, text = views(run, capsys)
    assert shown["checkpoint"]["step"] == FAST_RUN_STEPS
    assert shown["checkpoint"]["path"] == str(ckpts / LATEST)
    assert lines_of(text)["checkpoint"].startswith(f"checkpoints/{LATEST} (step {FAST_RUN_STEPS}")
    # LATEST lost too: the same one, as --resume would take it, saying why.
    (ckpts / "LATEST").unlink()
    _, shown, text = views(run, capsys)
    assert shown["checkpoint"]["path"] == str(ckpts / LATEST)
    assert lines_of(text)["checkpoint"].endswith(
        f"checkpoints/LATEST is missing; --resume and export take {LATEST}, the newest "
        "complete checkpoint that can be loaded)"
    )


def test_a_copied_runs_report_names_its_own_checkpoints(fast_run, tmp_path):
    from gpu_console.results import report

    run = fast_run.copy(tmp_path / "other")
    shutil.rmtree(run / "checkpoints" / LATEST)  # and one deleted since: said, not named
    html = report.page([report.load(run, run.parent)], [])
    assert f"<td>checkpoints/{LATEST} (not on disk)</td>" in html
    assert str(fast_run.run) not in html


def test_resume_and_export_of_a_run_without_run_toml_are_one_line(fast_run, procs, tmp_path):
    run = fast_run.copy(tmp_path / "runs")
    (run / "run.toml").unlink()
    resumed = procs.cli("run", "--resume", str(run), "--headless", "--devices", "cpu:1",
                        "--set", "train.max_steps=20")  # fmt: skip
    assert resumed.returncode == 2, resumed.stdout + resumed.stderr
    assert resumed.stderr.strip() == (
        f"gpu-console: --resume: {run}/run.toml is missing; restore it from a backup, or "
        "start a new run"
    )
    exported = procs.cli("export", str(run), "--out", str(tmp_path / "w.pt"))
    assert exported.returncode == 2, exported.stdout + exported.stderr
    assert exported.stderr.strip() == (
        f"gpu-console: {run}: run.toml is missing, and the model is built from it to load the "
        "checkpoint; restore it (history/run-N.toml keeps each earlier session's)"
    )
    assert not (tmp_path / "w.pt").exists()


def test_a_copied_runs_best_checkpoint_is_its_own(fast_run, tmp_path, capsys):
    run = fast_run.copy(tmp_path / "copy")
    status = json.loads((run / STATUS).read_text())
    original = str(fast_run.run / "checkpoints" / LATEST)  # as checkpoint.keep_best records it
    best = {"path": original, "step": FAST_RUN_STEPS, "metric": "eval/loss", "value": 1.5}
    (run / STATUS).write_text(json.dumps(status | {"best_checkpoint": best}))
    event = {"v": 1, "t": status["ended"], "kind": "checkpoint", "best": True, **best}
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")
    row, shown, text = views(run, capsys)
    assert row["best_checkpoint"]["path"] == shown["best_checkpoint"]["path"]
    assert row["best_checkpoint"]["path"] == str(run / "checkpoints" / LATEST)
    assert lines_of(text)["best checkpoint"] == (
        f"checkpoints/{LATEST} (step {FAST_RUN_STEPS}, eval/loss 1.5000)"
    )
    shutil.rmtree(run / "checkpoints" / LATEST)
    _, _, text = views(run, capsys)
    assert lines_of(text)["best checkpoint"] == (
        f"none on disk (checkpoints/{LATEST}, step {FAST_RUN_STEPS}, is gone)"
    )
