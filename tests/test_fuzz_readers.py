"""Fuzzing the file readers: any input gives a valid array or a one-line DataError, never another
exception and never a hang (each example runs under a wall-clock alarm)."""

import contextlib
import gzip
import math
import signal
import struct

import numpy as np
import pytest
from datafiles import cifar_batch_bytes, cifar_tar_gz_bytes, idx_bytes, random_cifar_batches
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from polytrain.data.cifar import decode_cifar_batch, load_cifar10
from polytrain.data.idx import read_idx
from polytrain.errors import DataError

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
SECONDS_PER_EXAMPLE = 5

VALID_IDX = idx_bytes(np.arange(2 * 5 * 4, dtype=np.uint8).reshape(2, 5, 4))
VALID_IDX_GZ = gzip.compress(VALID_IDX, mtime=0)
CIFAR_BATCHES = {name: cifar_batch_bytes(*arrays) for name, arrays in random_cifar_batches(1, seed=2).items()}
CIFAR_MEMBERS = {f"cifar-10-batches-bin/{name}": data for name, data in CIFAR_BATCHES.items()}


@contextlib.contextmanager
def no_hang(seconds=SECONDS_PER_EXAMPLE):
    def on_alarm(signum, frame):
        raise TimeoutError(f"reader still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def valid_or_data_error(read):
    """Run a reader; return its result, or None when it raised a one-line DataError."""
    with no_hang():
        try:
            return read()
        except DataError as exc:
            assert "\n" not in str(exc)
            return None


@st.composite
def mutated(draw, original: bytes):
    """original with a few truncations, byte overwrites, insertions and deletions."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["truncate", "overwrite", "insert", "delete"]))
        at = draw(st.integers(0, len(data)))
        if op == "truncate":
            del data[at:]
        elif op == "overwrite" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def check_idx(path, data):
    path.write_bytes(data)
    array = valid_or_data_error(lambda: read_idx(path))
    if array is not None:
        assert array.dtype == np.uint8 and 1 <= array.ndim <= 4 and array.size == math.prod(array.shape) > 0


@FUZZ
@given(data=st.binary(max_size=200))
@example(data=b"")
@example(data=b"\x00\x00\x08\x03" + struct.pack(">III", 10**6, 10**3, 10**3) + b"\x00" * 8)  # 10^12 items
def test_read_idx_arbitrary_bytes(folder, data):
    check_idx(folder / "plain-idx", data)
    check_idx(folder / "raw.gz", data)  # not gzip at all
    check_idx(folder / "wrapped.gz", gzip.compress(data, mtime=0))


@FUZZ
@given(
    dims=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=6),
    payload=st.binary(max_size=64),
    gz=st.booleans(),
)
@example(dims=[10**6, 10**3, 10**3], payload=b"\x00" * 16, gz=False)
@example(dims=[10**6, 10**3, 10**3], payload=b"\x00" * 16, gz=True)
def test_read_idx_arbitrary_headers(folder, dims, payload, gz):
    data = bytes([0, 0, 0x08, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + payload
    path = folder / ("header.gz" if gz else "header")
    check_idx(path, gzip.compress(data, mtime=0) if gz else data)


@FUZZ
@given(data=mutated(VALID_IDX))
def test_read_idx_mutated_plain(folder, data):
    check_idx(folder / "mutated-idx", data)


@FUZZ
@given(data=mutated(VALID_IDX_GZ))
def test_read_idx_mutated_gzip(folder, data):
    check_idx(folder / "mutated.gz", data)


def test_unmutated_files_read_back():
    # Guard for the properties above: the originals themselves are valid.
    assert decode_cifar_batch(CIFAR_BATCHES["test_batch.bin"], name="t")[0].shape == (1, 3, 32, 32)
    assert gzip.decompress(VALID_IDX_GZ) == VALID_IDX


def check_cifar_decode(data):
    result = valid_or_data_error(lambda: decode_cifar_batch(data, name="fuzz.bin"))
    if result is not None:
        images, labels = result
        assert images.shape == (len(labels), 3, 32, 32) and labels.max() < 10
        assert np.array_equal(labels, np.frombuffer(data, np.uint8)[::3073])


@FUZZ
@given(data=st.binary(max_size=7000) | mutated(CIFAR_BATCHES["data_batch_1.bin"]))
def test_decode_cifar_batch(data):
    check_cifar_decode(data)


def check_cifar_folder(folder, archive_bytes):
    for stale in folder.iterdir():
        stale.unlink()
    (folder / "cifar-10-binary.tar.gz").write_bytes(archive_bytes)
    result = valid_or_data_error(lambda: load_cifar10(folder))
    if result is not None:
        train_x, train_y, val_x, val_y = result
        assert train_x.shape[1:] == val_x.shape[1:] == (3, 32, 32)
        assert len(train_x) == len(train_y) and len(val_x) == len(val_y)


@pytest.fixture(scope="module")
def cifar_archive():
    return cifar_tar_gz_bytes(CIFAR_MEMBERS)


@FUZZ
@given(data=st.data())
def test_load_cifar10_mutated_archive(folder, cifar_archive, data):
    check_cifar_folder(folder, data.draw(mutated(cifar_archive)))


@FUZZ
@given(data=st.data())
def test_load_cifar10_mutated_tar_inside_valid_gzip(folder, cifar_archive, data):
    # Mutating the uncompressed tar reaches tarfile's header parsing instead of stopping at zlib/CRC.
    tar = gzip.decompress(cifar_archive)
    check_cifar_folder(folder, gzip.compress(data.draw(mutated(tar[:8192])) + tar[8192:], mtime=0))


@FUZZ
@given(data=st.binary(max_size=2000))
def test_load_cifar10_arbitrary_archive(folder, data):
    check_cifar_folder(folder, data)
    check_cifar_folder(folder, gzip.compress(data, mtime=0))
