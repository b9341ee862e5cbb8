"""IDX reader: exact decoding against hand-built bytes, and one DataError line per kind of damage."""

import gzip
import struct

import numpy as np
import pytest
from datafiles import IDX_NAMES, idx_bytes, write_bytes, write_idx, write_mnist_folder

from polytrain.data.idx import load_idx_dataset, load_idx_split, read_idx
from polytrain.errors import DataError

# Two 2x3 images, written byte by byte from the IDX specification.
HAND_BUILT = (
    bytes([0, 0, 0x08, 3])
    + struct.pack(">III", 2, 2, 3)
    + bytes([0, 1, 2, 3, 4, 5, 250, 251, 252, 253, 254, 255])
)


def assert_one_line_error(excinfo, *fragments):
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_decodes_hand_built_bytes_exactly(tmp_path, gz):
    path = write_bytes(tmp_path / "x-idx3-ubyte", HAND_BUILT, gz=gz)
    array = read_idx(path, expected_ndim=3)
    assert array.dtype == np.uint8
    assert array.shape == (2, 2, 3)
    assert array[0].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert array[1].tolist() == [[250, 251, 252], [253, 254, 255]]


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2)])
def test_read_idx_roundtrips_every_rank(tmp_path, shape):
    expected = np.arange(np.prod(shape), dtype=np.uint8).reshape(shape)
    assert np.array_equal(read_idx(write_idx(tmp_path / "f", expected)), expected)


@pytest.mark.parametrize("gz", [False, True])
def test_load_idx_dataset_returns_layout_and_values(tmp_path, gz):
    written = write_mnist_folder(tmp_path, n_train=6, n_val=4, gz=gz, seed=3)
    train_x, train_y, val_x, val_y = load_idx_dataset(tmp_path)
    assert train_x.shape == (6, 1, 28, 28) and train_x.dtype == np.uint8
    assert val_x.shape == (4, 1, 28, 28)
    assert train_y.dtype == np.int64 and val_y.dtype == np.int64
    assert np.array_equal(train_x[:, 0], written["train"][0])
    assert np.array_equal(train_y, written["train"][1])
    assert np.array_equal(val_x[:, 0], written["t10k"][0])
    assert np.array_equal(val_y, written["t10k"][1])


def test_load_idx_split_accepts_dotted_spelling(tmp_path):
    images = np.full((2, 4, 4), 9, dtype=np.uint8)
    write_idx(tmp_path / "t10k-images.idx3-ubyte", images)
    write_idx(tmp_path / "t10k-labels.idx1-ubyte", np.array([1, 2], dtype=np.uint8))
    x, y = load_idx_split(tmp_path, "t10k")
    assert x.shape == (2, 1, 4, 4) and y.tolist() == [1, 2]


def test_missing_file_names_folder_file_and_fix(tmp_path):
    write_mnist_folder(tmp_path)
    (tmp_path / IDX_NAMES["t10k", "labels"]).unlink()
    with pytest.raises(DataError) as excinfo:
        load_idx_dataset(tmp_path)
    assert_one_line_error(excinfo, str(tmp_path), "t10k-labels-idx1-ubyte", "--download")


def test_missing_folder(tmp_path):
    with pytest.raises(DataError) as excinfo:
        load_idx_split(tmp_path / "nowhere", "train")
    assert_one_line_error(excinfo, "nowhere", "--download")


def test_count_mismatch_names_both_files(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((3, 2, 2), dtype=np.uint8))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(4, dtype=np.uint8))
    with pytest.raises(DataError) as excinfo:
        load_idx_split(tmp_path, "train")
    assert_one_line_error(
        excinfo, "train-images-idx3-ubyte", "train-labels-idx1-ubyte", "3 images", "4 labels"
    )


def test_label_out_of_range(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((3, 2, 2), dtype=np.uint8))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([0, 9, 10], dtype=np.uint8))
    with pytest.raises(DataError) as excinfo:
        load_idx_split(tmp_path, "train")
    assert_one_line_error(excinfo, "train-labels-idx1-ubyte", "label 10 at index 2")


def test_swapped_files_fail_on_ndim(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros(3, dtype=np.uint8))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros((3, 2, 2), dtype=np.uint8))
    with pytest.raises(DataError) as excinfo:
        load_idx_split(tmp_path, "train")
    assert_one_line_error(excinfo, "train-images-idx3-ubyte", "1 dimensions but 3")


BROKEN_HEADERS = {
    "empty": (b"", "truncated"),
    "short magic": (b"\x00\x00", "truncated"),
    "bad magic": (b"\x01\x00\x08\x01" + struct.pack(">I", 1) + b"\x00", "not an IDX file"),
    "int32 type": (b"\x00\x00\x0c\x01" + struct.pack(">I", 1) + b"\x00\x00\x00\x00", "type 0x0c"),
    "zero ndim": (b"\x00\x00\x08\x00", "0 dimensions"),
    "five dims": (b"\x00\x00\x08\x05" + struct.pack(">5I", 1, 1, 1, 1, 1) + b"\x00", "5 dimensions"),
    "short dims": (b"\x00\x00\x08\x03" + struct.pack(">I", 2), "truncated"),
    "zero size": (b"\x00\x00\x08\x02" + struct.pack(">II", 3, 0), "zero size"),
}


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("case", sorted(BROKEN_HEADERS))
def test_broken_headers(tmp_path, case, gz):
    data, fragment = BROKEN_HEADERS[case]
    path = write_bytes(tmp_path / "broken-idx", data, gz=gz)
    with pytest.raises(DataError) as excinfo:
        read_idx(path)
    assert_one_line_error(excinfo, path.name, fragment, "--download")


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_payload_reports_sizes(tmp_path, gz):
    path = write_bytes(tmp_path / "x", HAND_BUILT[:-5], gz=gz)
    with pytest.raises(DataError) as excinfo:
        read_idx(path)
    assert_one_line_error(excinfo, "truncated", "expected 12 bytes", "found 7")


@pytest.mark.parametrize("gz", [False, True])
def test_trailing_garbage(tmp_path, gz):
    path = write_bytes(tmp_path / "x", HAND_BUILT + b"junk", gz=gz)
    with pytest.raises(DataError) as excinfo:
        read_idx(path)
    assert_one_line_error(excinfo, "trailing garbage")


@pytest.mark.parametrize("gz", [False, True])
def test_huge_claim_rejected_before_allocating(tmp_path, gz):
    header = bytes([0, 0, 0x08, 3]) + struct.pack(">III", 10**9, 1000, 1000)  # 10^15 bytes claimed
    path = write_bytes(tmp_path / "x", header + b"\x00" * 64, gz=gz)
    with pytest.raises(DataError) as excinfo:
        read_idx(path)
    assert_one_line_error(excinfo, "limit")


def test_plain_claim_larger_than_file_is_truncation(tmp_path):
    header = bytes([0, 0, 0x08, 1]) + struct.pack(">I", 10**6)
    path = write_bytes(tmp_path / "x", header + b"\x00" * 10)
    with pytest.raises(DataError) as excinfo:
        read_idx(path)
    assert_one_line_error(excinfo, "expected 1000000 bytes", "found 10")


def test_corrupt_gzip_stream(tmp_path):
    compressed = bytearray(gzip.compress(idx_bytes(np.arange(200, dtype=np.uint8).reshape(10, 20))))
    compressed[len(compressed) // 2] ^= 0xFF
    path = tmp_path / "x.gz"
    path.write_bytes(bytes(compressed))
    with pytest.raises(DataError) as excinfo:
        read_idx(path)
    assert_one_line_error(excinfo, "x.gz", "--download")


def test_truncated_gzip_stream(tmp_path):
    compressed = gzip.compress(idx_bytes(np.arange(200, dtype=np.uint8).reshape(10, 20)))
    path = tmp_path / "x.gz"
    path.write_bytes(compressed[:-12])
    with pytest.raises(DataError):
        read_idx(path)


def test_plain_bytes_named_gz(tmp_path):
    path = tmp_path / "x.gz"
    path.write_bytes(HAND_BUILT)
    with pytest.raises(DataError) as excinfo:
        read_idx(path)
    assert_one_line_error(excinfo, "x.gz")


def test_gzip_bytes_without_gz_suffix_gets_a_hint(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(gzip.compress(HAND_BUILT))
    with pytest.raises(DataError) as excinfo:
        read_idx(path)
    assert_one_line_error(excinfo, "gzip-compressed", "train-images-idx3-ubyte.gz")


def test_missing_file(tmp_path):
    with pytest.raises(DataError) as excinfo:
        read_idx(tmp_path / "absent-idx1-ubyte")
    assert_one_line_error(excinfo, "absent-idx1-ubyte", "not found")
