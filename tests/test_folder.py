"""Image-folder reader: both layouts, exact pixels and order, channels, sizes, broken files, one-line errors."""

import math
import os

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from polytrain.data import ArrayDataset
from polytrain.data import folder as folder_module
from polytrain.data.folder import FolderDataset, load_image_folder, scan_image_folder
from polytrain.errors import ConfigError, DataError, UserError


def pixels(seed, size=(8, 8), channels=3):
    """A distinct deterministic image: (H, W) for 1 channel, (H, W, 3) otherwise."""
    width, height = size
    shape = (height, width) if channels == 1 else (height, width, channels)
    return ((np.arange(math.prod(shape)) * 7 + seed * 31) % 256).astype(np.uint8).reshape(shape)


def write(path, array=None, *, seed=0, size=(8, 8), channels=3, mode=None, fmt=None):
    """Write an image with Pillow, creating folders; return the array written (channels-last)."""
    array = pixels(seed, size, channels) if array is None else array
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(array)
    if mode is not None:
        image = image.convert(mode)
    image.save(path, format=fmt)
    return array


def write_tree(root, counts, *, ext="png", start=0, **kwargs):
    """counts: {"train/cat": 3, ...}; writes 0.ext, 1.ext, ... with distinct seeds; returns {path: array}."""
    written, seed = {}, start
    for folder, count in counts.items():
        for i in range(count):
            path = root / folder / f"{i}.{ext}"
            written[path] = write(path, seed=seed, **kwargs)
            seed += 1
    return written


def chw(array):
    return array[np.newaxis] if array.ndim == 2 else array.transpose(2, 0, 1)


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def raises_one_line(error_type, call, *fragments):
    with pytest.raises(error_type) as excinfo:
        call()
    message = str(excinfo.value)
    assert "\n" not in message and "\r" not in message, message
    for fragment in fragments:
        assert str(fragment) in message, message
    return message


# ---------------------------------------------------------------- layouts, labels, order, pixels


def test_train_val_layout_sorted_classes_labels_and_exact_pixels(tmp_path):
    # created out of order so that sorting, not creation order, must decide the labels
    written = write_tree(
        tmp_path, {"train/dog": 2, "train/bird": 3, "train/cat": 1, "val/cat": 2, "val/dog": 1}
    )
    data = load_image_folder(tmp_path)
    assert isinstance(data, FolderDataset) and isinstance(data, ArrayDataset)
    assert data.classes == ["bird", "cat", "dog"]
    assert data.name == "folder" and data.num_classes == 3
    assert data.augment is False and data.flip is False and data.skipped == []
    assert data.train_y.tolist() == [0, 0, 0, 1, 2, 2]
    assert data.val_y.tolist() == [1, 1, 2]  # bird is missing from val/: allowed
    assert data.train_x.dtype == torch.uint8 and data.train_x.shape == (6, 3, 8, 8)
    expected_train = [
        written[tmp_path / "train" / c / f"{i}.png"]
        for c, n in (("bird", 3), ("cat", 1), ("dog", 2))
        for i in range(n)
    ]
    expected_val = [
        written[tmp_path / "val" / c / f"{i}.png"] for c, n in (("cat", 2), ("dog", 1)) for i in range(n)
    ]
    assert np.array_equal(data.train_x.numpy(), np.stack([chw(a) for a in expected_train]))
    assert np.array_equal(data.val_x.numpy(), np.stack([chw(a) for a in expected_val]))


@pytest.mark.parametrize("val_name", ["valid", "validation"])
def test_other_validation_folder_names(tmp_path, val_name):
    write_tree(tmp_path, {"train/a": 2, "train/b": 2, f"{val_name}/a": 1, f"{val_name}/b": 1})
    data = load_image_folder(tmp_path)
    assert (data.num_train, data.num_val) == (4, 2)
    assert data.val_y.tolist() == [0, 1]


def test_two_validation_folders_are_ambiguous(tmp_path):
    write_tree(tmp_path, {"train/a": 1, "val/a": 1, "valid/a": 1})
    raises_one_line(DataError, lambda: load_image_folder(tmp_path), tmp_path, "val/", "valid/", "keep one")


def test_single_tree_split_takes_the_last_sorted_files_of_each_class(tmp_path):
    written = write_tree(tmp_path, {"b": 10, "a": 5})
    data = load_image_folder(tmp_path, val_fraction=0.2)
    assert data.classes == ["a", "b"]
    assert data.train_y.tolist() == [0] * 4 + [1] * 8
    assert data.val_y.tolist() == [0] + [1] * 2
    # sorted paths: a/0..a/4 -> a/4 held out; b/0..b/9 -> b/8, b/9 held out
    expected_val = [
        written[tmp_path / "a" / "4.png"],
        written[tmp_path / "b" / "8.png"],
        written[tmp_path / "b" / "9.png"],
    ]
    assert np.array_equal(data.val_x.numpy(), np.stack([chw(a) for a in expected_val]))
    again = load_image_folder(tmp_path, val_fraction=0.2, seed=123)  # the split ignores the seed
    assert torch.equal(again.train_x, data.train_x) and torch.equal(again.val_x, data.val_x)
    assert torch.equal(again.train_y, data.train_y) and torch.equal(again.val_y, data.val_y)


@pytest.mark.parametrize(
    "count, fraction, held_out",
    [
        (2, 0.1, 1),  # at least one
        (3, 0.9, 2),  # at most n - 1
        (30, 0.1, 3),  # 0.1 * 30 is 3.0000000000000004 in floating point: still 3
        (10, 0.25, 3),  # ceil(2.5)
        (7, 0.5, 4),
    ],
)
def test_split_counts(tmp_path, count, fraction, held_out):
    write_tree(tmp_path, {"only": count}, size=(2, 2))
    classes, train_files, val_files = scan_image_folder(tmp_path, val_fraction=fraction)
    assert classes == ["only"]
    assert (len(train_files), len(val_files)) == (count - held_out, held_out)
    assert sorted(p for p, _ in train_files + val_files) == [p for p, _ in train_files + val_files]


def test_scan_reports_files_and_labels(tmp_path):
    write_tree(tmp_path, {"train/x": 2, "train/y": 1, "val/y": 1})
    classes, train_files, val_files = scan_image_folder(tmp_path)
    assert classes == ["x", "y"]
    assert train_files == [
        (tmp_path / "train/x/0.png", 0),
        (tmp_path / "train/x/1.png", 0),
        (tmp_path / "train/y/0.png", 1),
    ]
    assert val_files == [(tmp_path / "val/y/0.png", 1)]


def test_non_images_hidden_files_ignored_and_subfolders_included(tmp_path):
    write_tree(tmp_path, {"train/a": 1, "val/a": 1})
    (tmp_path / "train/a/notes.txt").write_text("not an image")
    (tmp_path / "train/a/.DS_Store").write_bytes(b"\0\1garbage")
    (tmp_path / "train/a/.hidden.png").write_bytes(b"garbage")  # hidden: ignored even with an image name
    (tmp_path / ".cache").mkdir()
    (tmp_path / "train/.ipynb_checkpoints").mkdir()  # hidden folder: not a class
    write(tmp_path / "train/.ipynb_checkpoints/x.png", seed=50)
    upper = write(tmp_path / "train/a/UPPER.PNG", seed=51)
    nested = write(tmp_path / "train/a/deeper/n.jpeg", seed=52, fmt="JPEG")
    classes, train_files, _ = scan_image_folder(tmp_path)
    assert classes == ["a"]
    assert [p.relative_to(tmp_path / "train/a").as_posix() for p, _ in train_files] == [
        "0.png",
        "UPPER.PNG",
        "deeper/n.jpeg",
    ]
    data = load_image_folder(tmp_path)
    assert data.num_train == 3
    assert np.array_equal(data.train_x[1].numpy(), chw(upper))
    assert np.abs(data.train_x[2].numpy().astype(int) - chw(nested)).mean() < 20  # JPEG is lossy


def test_symlink_loop_is_walked_once(tmp_path):
    write_tree(tmp_path, {"train/a": 2, "val/a": 1})
    os.symlink(tmp_path / "train/a", tmp_path / "train/a/loop")
    classes, train_files, _ = scan_image_folder(tmp_path)
    assert len(train_files) == 2


# ---------------------------------------------------------------- channels and formats


def test_all_grayscale_gives_one_channel_with_exact_pixels(tmp_path):
    written = write_tree(tmp_path, {"train/a": 2, "val/a": 1}, channels=1)
    data = load_image_folder(tmp_path)
    assert data.train_x.shape == (2, 1, 8, 8)
    assert np.array_equal(data.train_x[0, 0].numpy(), written[tmp_path / "train/a/0.png"])
    assert np.array_equal(data.val_x[0, 0].numpy(), written[tmp_path / "val/a/0.png"])


def test_mixed_gray_and_rgb_gives_three_channels(tmp_path):
    gray = write(tmp_path / "train/a/0.png", channels=1, seed=1)
    rgb = write(tmp_path / "train/a/1.png", seed=2)
    write(tmp_path / "val/a/0.png", channels=1, seed=3)
    data = load_image_folder(tmp_path)
    assert data.train_x.shape == (2, 3, 8, 8) and data.val_x.shape == (1, 3, 8, 8)
    assert np.array_equal(data.train_x[0].numpy(), np.stack([gray] * 3))
    assert np.array_equal(data.train_x[1].numpy(), chw(rgb))


def test_palette_rgba_la_bilevel_and_16_bit_modes(tmp_path):
    write(tmp_path / "train/a/p.png", seed=1, mode="P")
    rgba = np.dstack([pixels(2), np.full((8, 8), 128, np.uint8)])
    write(tmp_path / "train/a/rgba.png", rgba)
    write(tmp_path / "val/a/0.png", seed=3)
    data = load_image_folder(tmp_path)
    assert data.train_x.shape == (2, 3, 8, 8)
    assert np.array_equal(data.train_x[1].numpy(), chw(pixels(2)))  # alpha dropped

    gray_root = tmp_path / "gray"
    la = np.dstack([pixels(4, channels=1), np.full((8, 8), 9, np.uint8)])
    write(gray_root / "train/a/la.png", la)
    write(gray_root / "train/a/one.png", pixels(5, channels=1), mode="1")
    deep = (np.arange(64, dtype=np.uint16) * 1000).reshape(8, 8)
    write(gray_root / "val/a/deep.png", deep)
    data = load_image_folder(gray_root)
    assert data.train_x.shape == (2, 1, 8, 8)
    assert np.array_equal(data.train_x[0, 0].numpy(), pixels(4, channels=1))
    assert set(np.unique(data.train_x[1].numpy())) <= {0, 255}
    assert np.array_equal(data.val_x[0, 0].numpy(), (deep >> 8).astype(np.uint8))  # scaled, not clipped


@pytest.mark.parametrize(
    "ext, fmt", [("jpg", "JPEG"), ("bmp", "BMP"), ("gif", "GIF"), ("webp", "WEBP"), ("tif", "TIFF")]
)
def test_other_formats_decode(tmp_path, ext, fmt):
    write_tree(tmp_path, {"train/a": 2, "val/a": 1}, ext=ext, fmt=fmt, size=(12, 12))
    data = load_image_folder(tmp_path)
    assert data.train_x.shape[0] == 2 and data.train_x.shape[2:] == (12, 12)


def test_file_that_is_another_format_is_not_handed_to_other_decoders(tmp_path):
    write_tree(tmp_path, {"train/a": 1, "val/a": 1})
    (tmp_path / "train/a/fake.png").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n")
    raises_one_line(
        DataError,
        lambda: load_image_folder(tmp_path),
        tmp_path / "train/a/fake.png",
        "cannot decode the image",
        "--skip-bad",
    )


# ---------------------------------------------------------------- sizes


def test_mixed_sizes_name_both_files_and_suggest_image_size(tmp_path):
    write(tmp_path / "train/cat/a.png", size=(32, 32))
    write(tmp_path / "train/cat/b.png", size=(40, 30))
    write(tmp_path / "val/cat/c.png", size=(32, 32))
    message = raises_one_line(
        DataError,
        lambda: load_image_folder(tmp_path),
        f"{tmp_path / 'train/cat/b.png'} is 40x30 but {tmp_path / 'train/cat/a.png'} is 32x32",
        "--image-size 32",
        "32x32",
    )
    assert "c.png" not in message


def test_non_square_common_size_is_kept(tmp_path):
    write_tree(tmp_path, {"train/a": 2, "val/a": 1}, size=(12, 6))
    assert load_image_folder(tmp_path).train_x.shape == (2, 3, 6, 12)


def test_image_size_resizes_every_image(tmp_path):
    write(tmp_path / "train/a/0.png", size=(32, 32))
    write(tmp_path / "train/a/1.png", size=(40, 30), channels=1)
    same = write(tmp_path / "val/a/0.png", size=(16, 16), seed=9)
    data = load_image_folder(tmp_path, image_size=16)
    assert data.train_x.shape == (2, 3, 16, 16) and data.val_x.shape == (1, 3, 16, 16)
    assert np.array_equal(data.val_x[0].numpy(), chw(same))  # already 16x16: untouched


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "32"])
def test_image_size_must_be_positive_int(tmp_path, bad):
    write_tree(tmp_path, {"train/a": 1, "val/a": 1})
    raises_one_line(
        ConfigError, lambda: load_image_folder(tmp_path, image_size=bad), "--image-size", repr(bad)
    )


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_workers_must_be_positive_int(tmp_path, bad):
    write_tree(tmp_path, {"train/a": 1, "val/a": 1})
    raises_one_line(ConfigError, lambda: load_image_folder(tmp_path, workers=bad), "workers", repr(bad))


# ---------------------------------------------------------------- broken files and skip_bad


@pytest.mark.parametrize("ext, fmt", [("png", "PNG"), ("jpg", "JPEG")])
def test_truncated_image_names_the_file_and_skip_bad(tmp_path, ext, fmt, monkeypatch):
    write_tree(tmp_path, {"train/cat": 3, "val/cat": 1}, ext=ext, fmt=fmt, size=(64, 64))
    broken = tmp_path / f"train/cat/1.{ext}"
    truncate(broken)
    with Image.open(broken) as image:  # the header survives the cut: the pixel decoding must fail
        assert image.size == (64, 64)
    # a library that set LOAD_TRUNCATED_IMAGES must not turn the cut file into grey padding
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    raises_one_line(
        DataError,
        lambda: load_image_folder(tmp_path),
        f"{broken}: cannot decode the image (",
        "remove or replace the file",
        "--skip-bad",
    )
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # restored afterwards
    data = load_image_folder(tmp_path, skip_bad=True)
    assert data.skipped == [f"train/cat/1.{ext}"] and data.num_train == 2 and data.num_val == 1
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True


@pytest.mark.parametrize("ext, fmt", [("png", "PNG"), ("jpg", "JPEG")])
def test_file_cut_inside_its_header(tmp_path, ext, fmt):
    write_tree(tmp_path, {"train/cat": 2, "val/cat": 1}, ext=ext, fmt=fmt)
    broken = tmp_path / f"val/cat/0.{ext}"
    broken.write_bytes(broken.read_bytes()[:20])
    raises_one_line(
        DataError, lambda: load_image_folder(tmp_path), f"{broken}: cannot decode the image (", "--skip-bad"
    )


def test_garbage_file_fails_before_decoding(tmp_path):
    write_tree(tmp_path, {"train/a": 2, "val/a": 1})
    garbage = tmp_path / "train/a/0b.jpg"
    garbage.write_bytes(b"this is not a jpeg")
    message = raises_one_line(
        DataError,
        lambda: load_image_folder(tmp_path),
        f"{garbage}: cannot decode",
        "cannot identify image file",
        "--skip-bad",
    )
    assert message.count(str(garbage)) == 1  # Pillow's own copy of the path is removed


def test_skip_bad_lists_skipped_files_and_loads_the_rest(tmp_path):
    written = write_tree(tmp_path, {"train/a": 3, "train/b": 2, "val/a": 2, "val/b": 1}, size=(12, 12))
    truncate(tmp_path / "train/a/1.png")
    (tmp_path / "val/a/0.png").write_bytes(b"garbage")
    data = load_image_folder(tmp_path, skip_bad=True)
    assert data.skipped == ["train/a/1.png", "val/a/0.png"]
    assert data.train_y.tolist() == [0, 0, 1, 1] and data.val_y.tolist() == [0, 1]
    expected = [
        written[tmp_path / p] for p in ("train/a/0.png", "train/a/2.png", "train/b/0.png", "train/b/1.png")
    ]
    assert np.array_equal(data.train_x.numpy(), np.stack([chw(a) for a in expected]))
    assert np.array_equal(data.val_x[0].numpy(), chw(written[tmp_path / "val/a/1.png"]))


def test_skip_bad_class_without_a_readable_training_image(tmp_path):
    write_tree(tmp_path, {"train/a": 1, "train/b": 2, "val/a": 1})
    for name in ("0.png", "1.png"):
        truncate(tmp_path / "train/b" / name)
    raises_one_line(
        DataError,
        lambda: load_image_folder(tmp_path, skip_bad=True),
        "class 'b'",
        tmp_path / "train/b/0.png",
        "replace the files",
    )


def test_skip_bad_all_validation_images_unreadable(tmp_path):
    write_tree(tmp_path, {"train/a": 2, "val/a": 1})
    (tmp_path / "val/a/0.png").write_bytes(b"")
    raises_one_line(
        DataError,
        lambda: load_image_folder(tmp_path, skip_bad=True),
        "no validation image",
        tmp_path / "val/a/0.png",
    )


# ---------------------------------------------------------------- folder mistakes


@pytest.mark.parametrize("skip_bad", [False, True])
def test_empty_class_folder(tmp_path, skip_bad):
    write_tree(tmp_path, {"train/cat": 1, "val/cat": 1})
    (tmp_path / "train/dog").mkdir()
    (tmp_path / "train/dog/readme.txt").write_text("only text here")
    raises_one_line(
        DataError,
        lambda: load_image_folder(tmp_path, skip_bad=skip_bad),
        f"{tmp_path / 'train/dog'} has no images (.png, .jpg",
        "remove the folder or add images",
    )


def test_root_missing_or_a_file(tmp_path):
    raises_one_line(DataError, lambda: load_image_folder(tmp_path / "nope"), tmp_path / "nope", "not found")
    (tmp_path / "file.png").write_bytes(b"x")
    raises_one_line(
        DataError, lambda: load_image_folder(tmp_path / "file.png"), tmp_path / "file.png", "not a folder"
    )


def test_no_class_folders(tmp_path):
    write(tmp_path / "loose.png")
    raises_one_line(
        DataError,
        lambda: load_image_folder(tmp_path, val_fraction=0.1),
        tmp_path,
        "no class folders",
        "one folder per class",
    )
    write_tree(tmp_path / "tv", {"train/a": 1})
    (tmp_path / "tv/val").mkdir()
    raises_one_line(
        DataError, lambda: load_image_folder(tmp_path / "tv"), tmp_path / "tv/val", "no class folders"
    )


def test_val_fraction_refused_with_train_val_layout(tmp_path):
    write_tree(tmp_path, {"train/a": 2, "val/a": 1})
    raises_one_line(
        ConfigError,
        lambda: load_image_folder(tmp_path, val_fraction=0.1),
        tmp_path,
        "--val-fraction applies to a folder without train/ and val/ sub-folders; drop it",
    )


def test_single_tree_needs_val_fraction(tmp_path):
    write_tree(tmp_path, {"a": 2, "b": 2})
    raises_one_line(
        ConfigError,
        lambda: load_image_folder(tmp_path),
        tmp_path,
        "--val-fraction 0.1",
        "add train/ and val/ folders",
    )


@pytest.mark.parametrize("bad", [0, 1, -0.1, 1.5, float("nan"), True, "0.1"])
def test_val_fraction_must_lie_in_open_interval(tmp_path, bad):
    write_tree(tmp_path, {"a": 2})
    raises_one_line(
        ConfigError,
        lambda: load_image_folder(tmp_path, val_fraction=bad),
        "--val-fraction",
        "between 0 and 1",
    )


def test_split_needs_two_images_per_class(tmp_path):
    write_tree(tmp_path, {"a": 3, "b": 1})
    raises_one_line(
        DataError,
        lambda: load_image_folder(tmp_path, val_fraction=0.5),
        tmp_path / "b",
        "only 1 image",
        "at least 2",
    )


def test_val_class_not_in_train(tmp_path):
    write_tree(tmp_path, {"train/a": 1, "val/a": 1, "val/zebra": 1})
    raises_one_line(
        DataError,
        lambda: load_image_folder(tmp_path),
        tmp_path / "val/zebra",
        f"no matching folder in {tmp_path / 'train'}",
        f"add {tmp_path / 'train/zebra'}",
    )


def test_train_without_val_and_val_without_train(tmp_path):
    write_tree(tmp_path / "t", {"train/a": 2})
    raises_one_line(
        DataError,
        lambda: load_image_folder(tmp_path / "t"),
        tmp_path / "t/train",
        "no sibling val/",
        "--val-fraction",
    )
    write_tree(tmp_path / "v", {"val/a": 2})
    raises_one_line(
        DataError, lambda: load_image_folder(tmp_path / "v"), tmp_path / "v/val", "no sibling train/"
    )


def test_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError):
        load_image_folder(tmp_path / "missing")


# ---------------------------------------------------------------- parallel decoding


def test_parallel_decode_equals_sequential(tmp_path, monkeypatch):
    counts = {f"train/c{k}": 9 for k in range(3)} | {f"val/c{k}": 3 for k in range(3)}
    write_tree(tmp_path, counts, size=(12, 12))
    write_tree(tmp_path, {"train/c1": 2}, ext="jpg", fmt="JPEG", size=(12, 12), start=100)
    truncate(tmp_path / "train/c0/4.png")
    truncate(tmp_path / "val/c2/1.png")
    sequential = load_image_folder(tmp_path, skip_bad=True, workers=1)

    pools = []

    class CountingPool(folder_module.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(kwargs.get("max_workers"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(folder_module, "ProcessPoolExecutor", CountingPool)
    monkeypatch.setattr(folder_module, "PARALLEL_MIN_FILES", 1)
    parallel = load_image_folder(tmp_path, skip_bad=True, workers=2)
    assert pools == [2]
    for name in ("train_x", "train_y", "val_x", "val_y"):
        assert torch.equal(getattr(parallel, name), getattr(sequential, name)), name
    assert parallel.skipped == sequential.skipped == ["train/c0/4.png", "val/c2/1.png"]
    assert parallel.classes == sequential.classes

    with pytest.raises(DataError) as excinfo:  # the first bad file in sorted order, as sequentially
        load_image_folder(tmp_path, workers=2)
    assert f"{tmp_path / 'train/c0/4.png'}: cannot decode" in str(excinfo.value)


def test_train_on_a_folder_from_the_command_line_predicts_class_names(tmp_path, capsys):
    from polytrain.cli import main

    write_tree(tmp_path / "images", {"ant": 6, "bee": 6, "cat": 6}, size=(12, 12))
    truncate(tmp_path / "images" / "bee" / "2.png")
    out = tmp_path / "run"
    argv = [
        "train",
        "--dataset",
        "folder",
        "--data-dir",
        str(tmp_path / "images"),
        "--val-fraction",
        "0.3",
        "--skip-bad",
        "--model",
        "mlp",
        "--epochs",
        "1",
        "--batch-size",
        "4",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "skipped 1 unreadable image file (--skip-bad)" in printed
    assert (out / "skipped.txt").read_text() == "bee/2.png\n"
    assert main(["predict", str(out), "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "6 validation samples, " + lines[0].split(", ")[1]  # 2 held out per class
    names = {line.split("true ")[1].split()[0] for line in lines[1:]}
    assert names == {"ant", "bee", "cat"}


def test_folder_options_are_refused_with_other_datasets(tmp_path, capsys):
    from polytrain.cli import main

    assert main(["train", "--dataset", "synthetic", "--image-size", "32"]) == 2
    assert "--image-size is not used by --dataset synthetic" in capsys.readouterr().err
    assert main(["train", "--dataset", "folder"]) == 2
    assert "--dataset folder needs --data-dir DIR" in capsys.readouterr().err
