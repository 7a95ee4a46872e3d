"""load_video: frame folders, GIFs, arrays, .npy/.npz (and MP4 when OpenCV is there), sampled at
video_fps and thinned to max_frames; bad items raise MediaError naming the problem."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from relax.media import MediaError, MediaLimits, load_video, load_video_clip

LIMITS = MediaLimits(min_pixels=1)


def _frames(count: int, size: int = 16) -> np.ndarray:
    """Frame i is filled with grey level 10 * i (so a decoded frame tells its index)."""
    video = np.zeros((count, size, size, 3), np.uint8)
    for i in range(count):
        video[i] = 10 * i
    return video


def _index(frame: torch.Tensor) -> int:
    return round(float(frame.float().mean()) / 10)


def _gif(count: int, ms: int) -> bytes:
    images = [Image.fromarray(f) for f in _frames(count)]
    buffer = io.BytesIO()
    images[0].save(
        buffer, format="GIF", save_all=True, append_images=images[1:], duration=ms, loop=0
    )
    return buffer.getvalue()


def test_frame_folder_in_natural_order(tmp_path: Path) -> None:
    for i, frame in enumerate(_frames(12)):
        Image.fromarray(frame).save(tmp_path / f"frame{i}.png")  # frame10 sorts after frame9
    (tmp_path / "notes.txt").write_text("ignored")
    video = load_video(tmp_path, LIMITS)
    assert video.dtype == torch.uint8 and video.shape == (12, 16, 16, 3)
    assert [_index(f) for f in video] == list(range(12))


def test_arrays_lists_npy_and_npz(tmp_path: Path) -> None:
    frames = _frames(5)
    expected = torch.from_numpy(frames)
    assert torch.equal(load_video(frames, LIMITS), expected)
    assert torch.equal(load_video(torch.from_numpy(frames), LIMITS), expected)
    assert torch.equal(load_video(list(frames), LIMITS), expected)
    assert torch.equal(load_video([Image.fromarray(f) for f in frames], LIMITS), expected)
    np.save(tmp_path / "v.npy", frames)
    assert torch.equal(load_video(tmp_path / "v.npy", LIMITS), expected)
    assert torch.equal(load_video((tmp_path / "v.npy").read_bytes(), LIMITS), expected)


def test_gif_is_sampled_at_video_fps(tmp_path: Path) -> None:
    path = tmp_path / "a.gif"
    path.write_bytes(_gif(20, ms=100))  # 10 fps, 2 s
    clip = load_video_clip(path, MediaLimits(video_fps=2.0, min_pixels=1))
    assert clip.frames.shape == (4, 16, 16, 3) and clip.fps == pytest.approx(2.0)
    assert [_index(f) for f in clip.frames] == [2, 7, 12, 17]  # the middle of each half second


def test_known_rate_from_npz_and_argument(tmp_path: Path) -> None:
    np.savez(tmp_path / "v.npz", frames=_frames(8), fps=8.0)
    clip = load_video_clip(tmp_path / "v.npz", MediaLimits(video_fps=2.0, min_pixels=1))
    assert [_index(f) for f in clip.frames] == [2, 6] and clip.fps == pytest.approx(2.0)
    clip = load_video_clip(_frames(8), MediaLimits(video_fps=4.0, min_pixels=1), fps=8.0)
    assert [_index(f) for f in clip.frames] == [1, 3, 5, 7]
    # Slower than video_fps: every frame is kept, at its own rate.
    clip = load_video_clip(_frames(3), MediaLimits(video_fps=4.0, min_pixels=1), fps=1.0)
    assert len(clip.frames) == 3 and clip.fps == 1.0


def test_too_many_frames_are_thinned_or_refused() -> None:
    clip = load_video_clip(_frames(24), MediaLimits(max_frames=6, min_pixels=1))
    assert [_index(f) for f in clip.frames] == [2, 6, 10, 14, 18, 22]
    assert clip.fps == pytest.approx(2.0 * 6 / 24)
    with pytest.raises(
        MediaError, match=r"too many frames: 24 after sampling, limit 6 \(truncation is disabled\)"
    ):
        load_video(_frames(24), MediaLimits(max_frames=6, truncate=False))


def test_frames_are_resized_to_fit() -> None:
    video = load_video(np.zeros((2, 60, 120, 3), np.uint8), MediaLimits(max_pixels=1800))
    assert video.shape == (2, 30, 60, 3)


def test_missing_and_empty_sources(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match=r"video /no/such\.gif: file does not exist"):
        load_video("/no/such.gif")
    with pytest.raises(MediaError, match="does not exist"):
        load_video("/no/such.mp4")
    with pytest.raises(MediaError, match="folder has no image frames"):
        load_video(tmp_path)
    with pytest.raises(MediaError, match="has no frames"):
        load_video(np.zeros((0, 4, 4, 3), np.uint8))


def test_frames_of_different_sizes(tmp_path: Path) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "0.png")
    Image.new("RGB", (8, 9)).save(tmp_path / "1.png")
    with pytest.raises(MediaError, match="frame 1 is 8x9 but frame 0 is 8x8"):
        load_video(tmp_path, LIMITS)


def test_corrupt_frame_is_named(tmp_path: Path) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "0.png")
    buffer = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buffer, format="PNG")
    (tmp_path / "1.png").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    (tmp_path / "2.png").write_bytes(b"plain text")
    with pytest.raises(MediaError, match=r"video .*1\.png: corrupt or truncated"):
        load_video(tmp_path, LIMITS)
    (tmp_path / "1.png").unlink()
    with pytest.raises(MediaError, match=r"video .*2\.png: not an image"):
        load_video(tmp_path, LIMITS)


def test_truncated_gif_and_non_video_bytes() -> None:
    data = _gif(10, ms=100)
    with pytest.raises(MediaError, match="corrupt or truncated video"):
        load_video(data[: len(data) // 2])
    with pytest.raises(MediaError, match="not a video"):
        load_video(b"neither frames nor an animation")
    with pytest.raises(MediaError, match="uint8"):
        load_video(np.zeros((2, 4, 4, 3), np.float32))


def test_mp4_through_opencv(tmp_path: Path) -> None:
    cv2 = pytest.importorskip("cv2")
    path = tmp_path / "a.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (32, 32))
    if not writer.isOpened():
        pytest.skip("this OpenCV build cannot write MP4")
    for i in range(20):
        writer.write(np.full((32, 32, 3), 10 * i, np.uint8))
    writer.release()
    clip = load_video_clip(path, MediaLimits(video_fps=2.0, min_pixels=1))
    assert clip.frames.shape == (4, 32, 32, 3) and clip.fps == pytest.approx(2.0)
    assert [_index(f) for f in clip.frames] == [2, 7, 12, 17]
    assert torch.equal(
        load_video(path.read_bytes(), MediaLimits(video_fps=2.0, min_pixels=1)), clip.frames
    )
