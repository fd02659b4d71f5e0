"""Tests of pasa_diffusers.metrics.video: uint8 conversion, PNG/GIF/mp4 writers, side-by-side comparison frames."""

from __future__ import annotations

import subprocess
import sys

import imageio.v2 as iio2
import imageio.v3 as iio
import numpy as np
import pytest

from tests.console import PASA
from matplotlib import colormaps
from PIL import Image
from skimage import data
from skimage.transform import resize

from pasa_diffusers.metrics.limits import MIN_GIF_FPS
from pasa_diffusers.metrics.video import (
    SEPARATOR_PX,
    pad_even,
    side_by_side,
    to_uint8,
    write_gif,
    write_mp4,
    write_png_frames,
    write_video,
)

MAGENTA_U8 = [255, 0, 255]


def make_video(frames: int = 4, height: int = 64, width: int = 96, step: int = 6) -> np.ndarray:
    """A camera pan across scikit-image's coffee photo: (frames, height, width, 3) float32 in [0, 1]."""
    big = resize(data.coffee(), (height, width + step * (frames - 1)), anti_aliasing=True)
    return np.stack([big[:, i * step : i * step + width] for i in range(frames)]).astype(np.float32)


def read_mp4(path) -> np.ndarray:
    with iio2.get_reader(path, format="FFMPEG") as reader:
        return np.stack([frame for frame in reader.iter_data()])


def test_to_uint8_clips_rounds_and_paints_nonfinite_magenta():
    frame = np.array([[[0.5, -0.2, 1.3], [0.2, 0.4, 0.6]], [[np.nan, 0.5, 0.5], [0.1, np.inf, 0.1]]])
    pixels = to_uint8(frame)
    assert pixels.dtype == np.uint8 and pixels.shape == (2, 2, 3)
    assert pixels[0, 0].tolist() == [128, 0, 255]
    assert pixels[0, 1].tolist() == [51, 102, 153]
    assert pixels[1, 0].tolist() == MAGENTA_U8
    assert pixels[1, 1].tolist() == MAGENTA_U8
    video = to_uint8(np.stack([frame, frame * 0.25]))
    assert video.shape == (2, 2, 2, 3) and video[1, 0, 0].tolist() == [32, 0, 83]


def test_to_uint8_rejects_bad_input():
    with pytest.raises(ValueError, match="floating dtype"):
        to_uint8(np.zeros((4, 4, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="frames must be"):
        to_uint8(np.ones((4, 4, 4)))


def test_png_frames_round_trip_exactly(tmp_path):
    video = make_video()
    paths = write_png_frames(video, tmp_path / "pngs", prefix="fp16")
    assert [p.name for p in paths] == [f"fp16_{i:04d}.png" for i in range(len(video))]
    expected = to_uint8(video)
    for path, frame in zip(paths, expected):
        np.testing.assert_array_equal(iio.imread(path), frame)


def test_gif_reads_back_with_all_frames_and_loops(tmp_path):
    video = make_video(frames=5)
    path = write_gif(video, tmp_path / "clip.gif", fps=5)
    frames = iio.imread(path, plugin="pillow", index=None)
    assert frames.shape == (5, 64, 96, 3)
    assert np.abs(frames.astype(int) - to_uint8(video).astype(int)).mean() < 6.0
    with Image.open(path) as gif:
        assert gif.info["loop"] == 0
        assert gif.info["duration"] == 200


@pytest.mark.parametrize("height,width", [(64, 96), (63, 95)])
def test_mp4_reads_back_with_even_size(tmp_path, height, width):
    video = make_video(frames=5, height=height, width=width)
    path = write_mp4(video, tmp_path / "clip.mp4", fps=7)
    frames = read_mp4(path)
    assert frames.shape == (5, 64, 96, 3)
    error = np.abs(frames[:, :height, :width].astype(int) - to_uint8(video).astype(int)).mean()
    assert error < 8.0


def test_pad_even_replicates_edges():
    pixels = to_uint8(make_video(frames=2, height=5, width=7))
    padded = pad_even(pixels)
    assert padded.shape == (2, 6, 8, 3)
    np.testing.assert_array_equal(padded[:, :5, :7], pixels)
    np.testing.assert_array_equal(padded[:, 5, :7], pixels[:, 4])
    np.testing.assert_array_equal(padded[:, :5, 7], pixels[:, :, 6])
    even = pixels[:, :4, :6]
    assert pad_even(even) is even


def test_mp4_without_imageio_ffmpeg_raises_runtime_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    with pytest.raises(RuntimeError, match="imageio-ffmpeg"):
        write_mp4(make_video(), tmp_path / "clip.mp4")
    assert not (tmp_path / "clip.mp4").exists()


def test_write_video_writes_every_format(tmp_path):
    video = make_video(frames=3)
    written = write_video(video, tmp_path / "out", "pasa", fps=7)
    assert set(written) == {"mp4", "gif", "png"}
    assert written["mp4"] == tmp_path / "out" / "pasa.mp4" and read_mp4(written["mp4"]).shape[0] == 3
    assert iio.imread(written["gif"], plugin="pillow", index=None).shape[0] == 3
    assert sorted(p.name for p in written["png"].iterdir()) == [f"frame_{i:04d}.png" for i in range(3)]
    only_gif = write_video(video, tmp_path / "gif_only", "x", formats=("gif",))
    assert list(only_gif) == ["gif"] and not (tmp_path / "gif_only" / "x.mp4").exists()
    with pytest.raises(ValueError, match="webm"):
        write_video(video, tmp_path, "x", formats=("webm",))
    with pytest.raises(ValueError, match="fps"):
        write_gif(video, tmp_path / "x.gif", fps=0)


def test_write_video_replaces_the_frame_folder_of_a_longer_video_whole(tmp_path):
    write_video(make_video(frames=9), tmp_path, "pasa", formats=("png", "gif"))
    short = make_video(frames=5, step=3)
    written = write_video(short, tmp_path, "pasa", formats=("png", "gif"))
    frames = sorted(written["png"].iterdir())
    assert [p.name for p in frames] == [f"frame_{i:04d}.png" for i in range(5)]
    np.testing.assert_array_equal(np.stack([iio.imread(p) for p in frames]), to_uint8(short))
    assert iio.imread(written["gif"], plugin="pillow", index=None).shape[0] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pasa", "pasa.gif"]  # no temporary folder left


def test_write_video_refuses_a_frame_folder_holding_other_files(tmp_path):
    (tmp_path / "pasa").mkdir()
    (tmp_path / "pasa" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"pasa holds 'notes.txt', which is not a frame_NNNN.png frame"):
        write_video(make_video(frames=2), tmp_path, "pasa")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["notes.txt", "pasa"]  # nothing written


@pytest.mark.parametrize("blocked", ["pasa.gif", "pasa.mp4"])
def test_write_video_refuses_a_folder_where_a_file_goes_before_writing_anything(tmp_path, blocked):
    """Was: the mp4 written, then an IsADirectoryError at the GIF."""
    (tmp_path / blocked).mkdir()
    with pytest.raises(ValueError, match=rf"^{tmp_path / blocked} is a folder, where the {blocked[-3:]} video is to be "
                                         r"written; remove it or choose another --out$"):
        write_video(make_video(frames=2), tmp_path, "pasa")
    assert sorted(p.name for p in tmp_path.rglob("*")) == [blocked]  # nothing written


def test_write_video_replaces_a_link_to_an_earlier_file(tmp_path):
    """A symbolic link where a file goes is replaced (the rename replaces the link, not what it points to)."""
    (tmp_path / "elsewhere.gif").write_bytes(b"mine")
    (tmp_path / "pasa.gif").symlink_to(tmp_path / "elsewhere.gif")
    written = write_video(make_video(frames=2), tmp_path, "pasa", formats=("gif",))
    assert not written["gif"].is_symlink() and (tmp_path / "elsewhere.gif").read_bytes() == b"mine"


def test_a_gif_plays_frames_up_to_its_longest_delay_and_slower_is_refused(tmp_path):
    """A GIF's delay is a 16-bit count of hundredths of a second: 655.35 s a frame at most."""
    path = write_gif(make_video(frames=2, height=16, width=16), tmp_path / "slow.gif", fps=MIN_GIF_FPS)
    with Image.open(path) as gif:
        assert gif.info["duration"] == 655350
    with pytest.raises(ValueError, match=r"^fps must be at least 0.0015259 \(a GIF frame lasts at most 655.35 s\), "
                                         r"got 0.001$"):
        write_video(make_video(frames=2), tmp_path, "x", fps=0.001)
    assert list(tmp_path.iterdir()) == [path]  # nothing written


@pytest.mark.parametrize("command", ["generate", "compare"])
def test_the_command_line_refuses_an_fps_a_gif_cannot_play_before_any_work(command):
    """Was: --fps 0.001 passed the checks, and Pillow's struct.error came after every video was made."""
    done = subprocess.run([PASA, command, "--fps", "0.001"], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stderr) == (2, f"pasa {command}: error: argument --fps: must be at least 0.0015259 "
                                                 "(a GIF frame lasts at most 655.35 s), got 0.001\n")


def test_side_by_side_layout_and_heatmap():
    ref = make_video(frames=3)
    test = ref.copy()
    test[1, 10:20, 30:40] = np.clip(test[1, 10:20, 30:40] + 0.2, 0.0, 1.0)
    test[2, 5, 6, 1] = np.nan
    gain = 10.0
    out = side_by_side(ref, test, gain=gain)
    frames, height, width = ref.shape[:3]
    assert out.shape == (frames, height, 3 * width + 2 * SEPARATOR_PX, 3)
    assert np.isfinite(out).all() and out.min() >= 0.0 and out.max() <= 1.0

    ref_panel = out[:, :, :width]
    test_panel = out[:, :, width + SEPARATOR_PX : 2 * width + SEPARATOR_PX]
    heat = out[:, :, 2 * (width + SEPARATOR_PX) :]
    np.testing.assert_allclose(ref_panel, ref)
    np.testing.assert_array_equal(out[:, :, width : width + SEPARATOR_PX], 1.0)

    inferno = colormaps["inferno"]
    np.testing.assert_allclose(heat[0], np.broadcast_to(inferno(0.0)[:3], heat[0].shape))
    changed = np.clip(np.abs(test[1, 15, 35] - ref[1, 15, 35]).mean() * gain, 0, 1)
    np.testing.assert_allclose(heat[1, 15, 35], inferno(changed)[:3])
    assert not np.allclose(heat[1, 15, 35], heat[1, 0, 0])

    np.testing.assert_array_equal(test_panel[2, 5, 6], [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(heat[2, 5, 6], [1.0, 0.0, 1.0])
    assert to_uint8(out)[2, 5, 2 * (width + SEPARATOR_PX) + 6].tolist() == MAGENTA_U8


def test_side_by_side_rejects_bad_input():
    ref = make_video(frames=2)
    with pytest.raises(ValueError, match="same shape"):
        side_by_side(ref, ref[:, :32])
    with pytest.raises(ValueError, match="gain"):
        side_by_side(ref, ref, gain=0.0)
    with pytest.raises(ValueError, match="^test must have a floating dtype"):
        side_by_side(ref, to_uint8(ref))


@pytest.mark.parametrize("formats", [("mp4", "gif", "png"), ("png",), ("gif",)])
def test_write_video_refuses_bad_input_before_writing_anything(tmp_path, formats):
    empty = np.zeros((0, 16, 16, 3), dtype=np.float32)
    with pytest.raises(ValueError, match=r"^frames is empty \(F, H, W, 3\): got shape \(0, 16, 16, 3\)"):
        write_video(empty, tmp_path / "out", "x", formats=formats)
    with pytest.raises(ValueError, match=r"^frames must hold values in \[0, 1\], found values in "
                                         r"\[[0-9]+, [0-9]+\] \(0\.\.255 pixels\? divide by 255\)"):
        write_video(np.round(make_video(frames=2) * 255), tmp_path / "out", "x", formats=formats)
    with pytest.raises(ValueError, match="fps must be a finite number > 0, got 0"):
        write_video(make_video(frames=2), tmp_path / "out", "x", fps=0, formats=formats)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="formats is empty"):
        write_video(make_video(frames=2), tmp_path / "out", "x", formats=())
