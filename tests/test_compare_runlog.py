"""The run folder of `pasa compare` (pasa_diffusers/pipelines/runlog.py): logs, damaged lines, manifests, the lock; its samples,
and the --images/--seeds flags; no model."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import PIL.Image
import pytest

from pasa_diffusers.cli import main
from pasa_diffusers.cli.compare import image_list, seed_list
from pasa_diffusers.pipelines import runlog
from pasa_diffusers.pipelines.samples import image_identity, make_samples

RUN = {"model": "tiny", "seeds": [0, 1], "num_frames": 2}


def rec(image: str, seed: int, backend: str, value: float = 1.0) -> dict:
    """A record of the logs' format: every field of ``runlog.RECORD_FIELDS``, each of its type and range."""
    return {"image": image, "seed": seed, "sample": f"{image}_s{seed}", "backend": backend, "psnr": value, "ssim": 0.5,
            "lpips": None, "temporal_psnr": 30.0, "flicker": 1.0, "frames": 2, "nonfinite_frames": 0,
            "first_nonfinite": None, "identical_frames": 0, "psnr_per_frame": [value, value],
            "ssim_per_frame": [0.5, 0.5], "seconds": 1.5, "rank": 0,
            "fallbacks": {"calls": 4, "fallback_calls": 1, "reasons": {"single key": 1},
                          "int8_blocks": {"blocks": 0, "in_16_bits": 0}}}


@pytest.mark.parametrize("change, why", [
    ({"psnr": None}, r"psnr is null, but 2 of 2 frames have a value in psnr_per_frame: psnr is null exactly when no "
                     r"frame has one"),
    ({"nonfinite_frames": -3}, r"nonfinite_frames is -3; expected an integer in \[0, 2\] \(frames\)"),
    ({"nonfinite_frames": 3}, r"nonfinite_frames is 3; expected an integer in \[0, 2\] \(frames\)"),
    ({"nonfinite_frames": 1}, r"first_nonfinite is null; expected null with no non-finite frame, else a frame index in \[0, 1\] "
                              r"\(1 non-finite\)"),
    ({"nonfinite_frames": True, "first_nonfinite": 0}, r"nonfinite_frames is true; expected an integer"),
    ({"psnr": "12"}, r'psnr is "12"; expected a number >= 0, "inf" or null'),
    ({"psnr": -4.0}, r'psnr is -4.0; expected a number >= 0, "inf" or null'),
    ({"ssim": 1.5}, r"ssim is 1.5; expected a number in \[-1, 1\] or null"),
    ({"ssim_per_frame": [0.5]}, r"ssim_per_frame is \[0.5\]; expected a list of 2 values \(frames\)"),
    ({"lpips": "inf"}, r'lpips is "inf"; expected a number >= 0 or null'),
    ({"frames": 0}, r"frames is 0; expected an integer >= 1"),
    ({"seconds": "inf"}, r'seconds is "inf"; expected a finite number >= 0'),
    ({"fallbacks": {"calls": 1, "fallback_calls": 2, "reasons": {}}}, r"fallbacks is .*fallback_calls <= calls"),
])
def test_a_record_of_the_wrong_type_or_range_is_refused_naming_file_line_and_field(tmp_path, change, why):
    """Read back, a record whose values are not what pasa compare writes stops the run (was: a null PSNR dropped
    the sample from the means, -3 non-finite frames reached the verdict)."""
    good = rec("builtin:rocket", 0, "pasa", 31.5)
    assert runlog.record_problem(good) is None
    path = tmp_path / runlog.SAMPLES
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "seed": 1, **change}) + "\n")
    with pytest.raises(runlog.DamagedLogError, match=rf"^{path}, line 2: damaged \({why}.*\); delete that line"):
        runlog.read_log(path)


def test_the_records_of_a_video_that_is_not_finite_are_valid():
    """null scores where no frame could be scored, "inf" where every frame is identical: records compare writes."""
    broken = {**rec("builtin:rocket", 0, "naive-half"), "psnr": None, "ssim": None, "temporal_psnr": None,
              "flicker": None, "psnr_per_frame": [None, None], "ssim_per_frame": [None, None], "nonfinite_frames": 2,
              "first_nonfinite": 0}
    identical = {**rec("builtin:rocket", 0, "fp32"), "psnr": "inf", "psnr_per_frame": ["inf", "inf"],
                 "identical_frames": 2, "temporal_psnr": "inf", "ssim": 1.0000000596046448,
                 "ssim_per_frame": [1.0000001192092896, 1.0]}  # float32 frames: an SSIM of 1 + 2**-23
    assert runlog.record_problem(broken) is None and runlog.record_problem(identical) is None


def test_seed_list():
    assert seed_list("0-3,7,9-10") == [0, 1, 2, 3, 7, 9, 10]
    assert seed_list(" 5 ") == [5]
    assert seed_list(f"{2**63 - 1}") == [2**63 - 1]
    for bad, message in [("3-1", "ranges go up"), ("1,,2", "empty entry"), ("a", "expected seeds"),
                         ("-1", "expected seeds"), ("0-2,2", "seed 2 is named more than once"),
                         (f"{2**63}", "2\\*\\*63-1"), ("0-100000", "more than 100000 seeds")]:
        with pytest.raises(Exception, match=message):
            seed_list(bad)


def test_image_list_expands_folders_and_builtins(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for name in ("b.png", "a.JPG"):
        PIL.Image.new("RGB", (8, 8)).save(folder / name, format="PNG")
    (folder / "notes.txt").write_text("not an image")
    assert image_list(f"builtin:all,{folder}") == ["builtin:astronaut", "builtin:coffee", "builtin:rocket",
                                                   str(folder / "a.JPG"), str(folder / "b.png")]
    with pytest.raises(Exception, match="named more than once"):
        image_list(f"{folder},{folder / 'b.png'}")
    with pytest.raises(Exception, match="no such file or folder"):
        image_list(str(tmp_path / "missing.png"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(Exception, match="holds no image"):
        image_list(str(empty))


def test_flag_errors_are_one_line_naming_the_flag(tmp_path, capsys):
    bad_image = tmp_path / "bad.png"
    bad_image.write_text("not a png")
    cases = [(["--seeds", "4-2"], "argument --seeds/--seed: '4-2'"),
             (["--images", "builtin:moon"], "argument --images/--image: unknown builtin:moon"),
             (["--images", str(bad_image)], f"--images {bad_image}: not a readable image"),
             (["--backends", "pasa,fp32"], "argument --backends: unknown backend(s) fp32"),
             (["--worst", "-1"], "argument --worst")]
    for argv, message in cases:
        assert main(["compare", *argv, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("pasa compare: error: ") and message in err and err.count("\n") == 1, err


def test_make_samples_names_and_order():
    samples = make_samples(["builtin:rocket", "/a/x.png", "/b/x.png"], [3, 1])
    assert [s.label for s in samples] == ["rocket-seed3", "rocket-seed1", "x-seed3", "x-seed1", "x-2-seed3",
                                          "x-2-seed1"]
    assert samples[2].key == ("/a/x.png", 3)
    with pytest.raises(ValueError, match="seed"):
        make_samples(["builtin:rocket"], [1, 1])


def test_image_identity_follows_the_file_bytes(tmp_path):
    path = tmp_path / "x.png"
    path.write_bytes(b"one")
    first = image_identity(str(path))
    path.write_bytes(b"two")
    assert image_identity(str(path))["sha256"] != first["sha256"]
    assert image_identity("builtin:rocket") == {"image": "builtin:rocket", "sha256": None}


def test_log_writer_appends_and_cuts_a_line_left_unfinished(tmp_path):
    path = tmp_path / runlog.SAMPLES
    with runlog.LogWriter(path) as log:
        log.append(rec("a", 0, "pasa"))
    with open(path, "a") as f:
        f.write('{"image": "a", "seed": 1, "back')  # a kill in the middle of a line
    assert runlog.read_log(path) == [rec("a", 0, "pasa")]
    with runlog.LogWriter(path) as log:
        log.append(rec("a", 1, "pasa"))
    assert runlog.read_log(path) == [rec("a", 0, "pasa"), rec("a", 1, "pasa")]
    assert path.read_text().count("\n") == 2
    with open(path, "a") as f:
        f.write("garbage\n")
    with pytest.raises(runlog.DamagedLogError, match=r"samples.jsonl, line 3: damaged \(not a JSON record"):
        runlog.read_log(path)


@pytest.mark.parametrize("line, why", [
    ('{"image": "a", "seed": 1, "back\n', "not a JSON record: Unterminated string"),
    ("[1, 2]\n", "not a JSON object but list"),
    ('{"image": "a", "seed": 1, "backend": "pasa"}\n', "a record without sample, psnr"),
    (json.dumps({**rec("a", 0, "pasa"), "seed": "0"}) + "\n", "image, backend and seed must be"),
    (b'{"image": "\xc3\x28"}\n', "not text (invalid continuation byte at byte 11)"),
])
def test_a_damaged_line_names_the_file_the_line_and_the_repair(tmp_path, line, why):
    path = tmp_path / runlog.SAMPLES
    good = json.dumps(rec("a", 0, "pasa")) + "\n"
    path.write_bytes(good.encode() + (line if isinstance(line, bytes) else line.encode()) + good.encode())
    with pytest.raises(runlog.DamagedLogError) as info:
        runlog.read_log(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 2: damaged ({why}") and "\n" not in message
    assert message.endswith("delete that line (its result is computed again when you rerun the command) or start "
                            "over with a new --out")


def test_a_record_of_another_run_is_a_damaged_line(tmp_path):
    with runlog.LogWriter(tmp_path / runlog.SAMPLES) as log:
        log.append(rec("a", 0, "pasa"))
        log.append(rec("b", 0, "pasa"))
    assert len(runlog.done_records(tmp_path)) == 2
    with pytest.raises(runlog.DamagedLogError, match=r"line 2: a record of \('b', 0, 'pasa'\), which is not part"):
        runlog.done_records(tmp_path, {("a", 0, "pasa")})


def test_check_folder_resumes_the_same_run_and_refuses_others(tmp_path):
    out = tmp_path / "run"
    assert runlog.check_folder(out, RUN) is False
    runlog.prepare_folder(out, RUN, "pasa compare")
    assert runlog.check_folder(out, RUN) is True
    with runlog.LogWriter(out / runlog.SAMPLES) as log:
        log.append(rec("a", 0, "pasa"))
    with pytest.raises(runlog.MixedRunError, match=r"holds another run \(seeds \[0, 1\] there, \[0, 1, 2\] now\)"):
        runlog.check_folder(out, {**RUN, "seeds": [0, 1, 2]})
    with pytest.raises(runlog.MixedRunError, match="model \"tiny\" there, \"tiny-resonant\" now; num_frames"):
        runlog.check_folder(out, {**RUN, "model": "tiny-resonant", "num_frames": 3})
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "report.json").write_text("{}")
    with pytest.raises(runlog.MixedRunError, match="holds no run.json"):
        runlog.check_folder(foreign, RUN)


def test_a_manifest_without_records_is_taken_over_and_records_are_not(tmp_path):
    other = {**RUN, "seeds": [0, 1, 2]}
    runlog.prepare_folder(tmp_path, RUN, "first")
    assert runlog.check_folder(tmp_path, other) is False, "no result is there: nothing to protect"
    runlog.prepare_folder(tmp_path, other, "second")
    assert json.loads((tmp_path / runlog.MANIFEST).read_text())["run"] == other
    runlog.check_manifest(tmp_path, other)
    with pytest.raises(runlog.MixedRunError, match="holds another run"):
        runlog.check_manifest(tmp_path, RUN)
    (tmp_path / runlog.SAMPLES).write_text(json.dumps(rec("a", 0, "pasa")) + "\n")
    with pytest.raises(runlog.MixedRunError, match="holds another run"):
        runlog.check_folder(tmp_path, RUN)


def test_prepare_folder_keeps_the_report_and_the_first_command(tmp_path):
    runlog.prepare_folder(tmp_path, RUN, "first")
    (tmp_path / "report.json").write_text("old")
    (tmp_path / runlog.SAMPLES).write_text(json.dumps(rec("a", 0, "pasa")) + "\n")
    runlog.prepare_folder(tmp_path, RUN, "second")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", runlog.MANIFEST, runlog.SAMPLES]
    assert json.loads((tmp_path / runlog.MANIFEST).read_text())["command"] == "first"


def test_the_folder_lock_admits_one_holder_and_leaves_no_trace_in_the_run(tmp_path):
    out = tmp_path / "new"
    with runlog.FolderLock(out) as first:
        first.acquire()
        first.acquire()  # again: a no-op
        assert runlog.check_folder(out, RUN) is False, "a folder holding only the lock file is empty"
        with pytest.raises(runlog.FolderInUseError, match=rf"--out {out}: another pasa compare is running into "
                                                          rf"this folder \(pid and host {os.getpid()} "):
            runlog.FolderLock(out).acquire()
    with runlog.FolderLock(out) as second:
        second.acquire()


def test_the_lock_of_a_killed_process_is_free(tmp_path):
    code = ("import sys, time; from pasa_diffusers.pipelines.runlog import FolderLock; "
            f"FolderLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(runlog.FolderInUseError, match=f"pid and host {holder.pid} "):
            runlog.FolderLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with runlog.FolderLock(tmp_path) as lock:
        lock.acquire()


def test_a_removed_lock_file_is_never_held_twice(tmp_path, monkeypatch):
    """``remove=True`` (``pasa generate``'s lock) deletes the file on release. A run that opened the file just before
    its holder removed it, and locks it after a third run has locked the new file, sees that it holds a removed file,
    and is refused by the third run instead of running beside it."""
    first = runlog.FolderLock(tmp_path, name=".pasa.lock", holder="another pasa generate", remove=True)
    first.acquire()
    third = runlog.FolderLock(tmp_path, name=".pasa.lock", holder="another pasa generate", remove=True)
    flock, interleaved = runlog.fcntl.flock, []

    def the_others_move_between_open_and_lock(fd, operation):
        if not interleaved:  # the second run has opened the first run's file, and not locked it yet
            interleaved.append(True)
            first.release()
            assert not (tmp_path / ".pasa.lock").exists()
            third.acquire()
        return flock(fd, operation)

    monkeypatch.setattr(runlog.fcntl, "flock", the_others_move_between_open_and_lock)
    with pytest.raises(runlog.FolderInUseError, match=f"another pasa generate \\(pid and host {os.getpid()} "):
        runlog.FolderLock(tmp_path, name=".pasa.lock", holder="another pasa generate", remove=True).acquire()
    third.release()
    assert list(tmp_path.iterdir()) == []


def test_merge_logs_unites_shards_in_order_once_each(tmp_path):
    order = [("a", 0, "pasa"), ("a", 0, "bf16"), ("a", 1, "pasa"), ("a", 1, "bf16")]
    with runlog.LogWriter(runlog.log_path(tmp_path, 0, 1)) as log:
        log.append(rec("a", 1, "bf16", 4.0))
    with runlog.LogWriter(runlog.log_path(tmp_path, 1, 2)) as log:
        log.append(rec("a", 0, "bf16", 2.0))
        log.append(rec("a", 1, "bf16", 99.0))  # a duplicate (a crash between merge and cleanup): the first wins
    with runlog.LogWriter(runlog.log_path(tmp_path, 0, 2)) as log:
        log.append(rec("a", 0, "pasa", 1.0))
    assert set(runlog.done_records(tmp_path)) == {order[0], order[1], order[3]}
    merged = runlog.merge_logs(tmp_path, order)
    assert [runlog.record_key(r) for r in merged] == [order[0], order[1], order[3]]
    assert [r["psnr"] for r in merged] == [1.0, 2.0, 4.0]
    assert runlog.read_log(tmp_path / runlog.SAMPLES) == merged
    assert not (tmp_path / runlog.SHARDS).exists()
    with pytest.raises(runlog.DamagedLogError, match="not part of this run"):
        runlog.merge_logs(tmp_path, order[:2])
