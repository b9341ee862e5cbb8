"""CIFAR-10 binary reader: exact values by byte offset, three layouts, and each kind of damage."""

import gzip

import numpy as np
import pytest
from datafiles import (
    cifar_batch_bytes,
    cifar_tar_gz_bytes,
    random_cifar_batches,
    write_bytes,
    write_cifar_folder,
)

from polytrain.data.cifar import decode_cifar_batch, load_cifar10
from polytrain.errors import DataError

RECORD = 3073


def assert_one_line_error(excinfo, *fragments):
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_decode_matches_byte_offsets_of_the_format():
    rng = np.random.default_rng(5)
    blob = bytearray(rng.integers(0, 256, size=4 * RECORD, dtype=np.uint8).tobytes())
    for record in range(4):
        blob[record * RECORD] = record + 3  # a valid label
    images, labels = decode_cifar_batch(bytes(blob), name="b.bin")
    assert labels.tolist() == [3, 4, 5, 6] and labels.dtype == np.int64
    assert images.shape == (4, 3, 32, 32) and images.dtype == np.uint8
    for record, channel, row, col in [
        (0, 0, 0, 0),
        (1, 2, 31, 31),
        (2, 1, 5, 17),
        (3, 0, 31, 0),
        (3, 2, 0, 31),
    ]:
        offset = record * RECORD + 1 + channel * 1024 + row * 32 + col
        assert images[record, channel, row, col] == blob[offset]


@pytest.mark.parametrize("layout", ["flat", "subdir", "tar"])
def test_load_cifar10_layouts(tmp_path, layout):
    written = write_cifar_folder(tmp_path, n_per_file=7, seed=11, layout=layout)
    train_x, train_y, val_x, val_y = load_cifar10(tmp_path)
    assert train_x.shape == (35, 3, 32, 32) and train_x.dtype == np.uint8
    assert val_x.shape == (7, 3, 32, 32) and val_x.flags.c_contiguous
    assert train_y.dtype == np.int64 and val_y.dtype == np.int64
    expected_train_x = np.concatenate([written[f"data_batch_{i}.bin"][0] for i in range(1, 6)])
    expected_train_y = np.concatenate([written[f"data_batch_{i}.bin"][1] for i in range(1, 6)])
    assert np.array_equal(train_x, expected_train_x)
    assert np.array_equal(train_y, expected_train_y)
    assert np.array_equal(val_x, written["test_batch.bin"][0])
    assert np.array_equal(val_y, written["test_batch.bin"][1])


def test_tar_ignores_unexpected_members(tmp_path):
    batches = random_cifar_batches(2, seed=1)
    members = {f"cifar-10-batches-bin/{name}": cifar_batch_bytes(*arrays) for name, arrays in batches.items()}
    members["cifar-10-batches-bin/batches.meta.txt"] = b"airplane\n"
    members["../../evil.bin"] = b"x"
    write_bytes(tmp_path / "cifar-10-binary.tar.gz", cifar_tar_gz_bytes(members))
    train_x, _, _, val_y = load_cifar10(tmp_path)
    assert len(train_x) == 10 and np.array_equal(val_y, batches["test_batch.bin"][1])
    assert not (tmp_path / "cifar-10-batches-bin").exists()  # nothing extracted to disk


def test_tar_missing_member(tmp_path):
    batches = random_cifar_batches(2)
    members = {
        name: cifar_batch_bytes(*arrays) for name, arrays in batches.items() if name != "data_batch_3.bin"
    }
    write_bytes(tmp_path / "cifar-10-binary.tar.gz", cifar_tar_gz_bytes(members))
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, "cifar-10-binary.tar.gz", "data_batch_3.bin")


def test_tar_duplicate_member(tmp_path):
    blob = cifar_batch_bytes(*random_cifar_batches(1)["test_batch.bin"])
    write_bytes(
        tmp_path / "cifar-10-binary.tar.gz",
        cifar_tar_gz_bytes({"a/test_batch.bin": blob, "b/test_batch.bin": blob}),
    )
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, "twice")


@pytest.mark.parametrize("cut", [10, 1000, -20])
def test_truncated_archive(tmp_path, cut):
    write_cifar_folder(tmp_path, n_per_file=3, layout="tar")
    archive = tmp_path / "cifar-10-binary.tar.gz"
    archive.write_bytes(archive.read_bytes()[:cut])
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, "cifar-10-binary.tar.gz", "--download")


def test_archive_that_is_not_a_tar(tmp_path):
    write_bytes(tmp_path / "cifar-10-binary.tar.gz", gzip.compress(b"hello" * 1000))
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, "cifar-10-binary.tar.gz")


def test_missing_files_are_listed(tmp_path):
    write_cifar_folder(tmp_path, n_per_file=2)
    (tmp_path / "data_batch_2.bin").unlink()
    (tmp_path / "test_batch.bin").unlink()
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, str(tmp_path), "data_batch_2.bin, test_batch.bin", "--download")


def test_empty_folder(tmp_path):
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, str(tmp_path), "cifar-10-binary.tar.gz", "--download")


@pytest.mark.parametrize(
    "delta, fragment", [(+5, "5 bytes extra"), (-5, "5 missing"), (-3 * RECORD, "empty")]
)
def test_bad_length_names_file_and_bytes(tmp_path, delta, fragment):
    write_cifar_folder(tmp_path, n_per_file=3)
    path = tmp_path / "data_batch_4.bin"
    data = path.read_bytes()
    path.write_bytes(data + b"\x00" * delta if delta > 0 else data[:delta])
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, "data_batch_4.bin", fragment, "--download")


def test_label_out_of_range(tmp_path):
    write_cifar_folder(tmp_path, n_per_file=3)
    path = tmp_path / "test_batch.bin"
    data = bytearray(path.read_bytes())
    data[2 * RECORD] = 10
    path.write_bytes(bytes(data))
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, "test_batch.bin", "label 10 of record 2")
