"""Downloads from a local http.server: verification, atomic placement, no repeat downloads, clear errors."""

import functools
import hashlib
import http.server
import socket
import threading
from pathlib import Path

import pytest

from polytrain.data import download
from polytrain.data.download import (
    SOURCES,
    DatasetSource,
    default_cache_dir,
    download_file,
    ensure_dataset_files,
)
from polytrain.errors import ConfigError, DataError

PAYLOAD = bytes(range(256)) * 50
PAYLOAD_MD5 = hashlib.md5(PAYLOAD).hexdigest()


class CountingHandler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        self.server.requests.append(self.path)
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path):
    """Serve tmp_path/served on 127.0.0.1; yields (base url, served folder, list of request paths)."""
    served = tmp_path / "served"
    served.mkdir()
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(CountingHandler, directory=str(served))
    )
    httpd.requests = []
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", served, httpd.requests
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def leftovers(folder: Path):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".part"))


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_good_download(server, tmp_path):
    url, served, requests = server
    (served / "file.bin").write_bytes(PAYLOAD)
    dest = tmp_path / "out" / "file.bin"
    assert download_file(url + "file.bin", dest, md5=PAYLOAD_MD5) == dest
    assert dest.read_bytes() == PAYLOAD
    assert requests == ["/file.bin"]
    assert leftovers(dest.parent) == []


def test_checksum_mismatch_leaves_nothing_behind(server, tmp_path):
    url, served, _ = server
    (served / "file.bin").write_bytes(PAYLOAD)
    dest = tmp_path / "out" / "file.bin"
    wrong = "0" * 32
    with pytest.raises(DataError) as excinfo:
        download_file(url + "file.bin", dest, md5=wrong)
    message = str(excinfo.value)
    assert "\n" not in message
    assert "file.bin" in message and wrong in message and PAYLOAD_MD5 in message
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []


def test_present_file_is_not_downloaded_again(server, tmp_path):
    url, served, requests = server
    (served / "file.bin").write_bytes(b"different content")
    dest = tmp_path / "file.bin"
    dest.write_bytes(PAYLOAD)
    download_file(url + "file.bin", dest, md5=PAYLOAD_MD5)
    assert requests == []
    assert dest.read_bytes() == PAYLOAD


def test_damaged_present_file_is_replaced(server, tmp_path):
    url, served, requests = server
    (served / "file.bin").write_bytes(PAYLOAD)
    dest = tmp_path / "file.bin"
    dest.write_bytes(PAYLOAD[:100])
    download_file(url + "file.bin", dest, md5=PAYLOAD_MD5)
    assert dest.read_bytes() == PAYLOAD and requests == ["/file.bin"]


def test_unreachable_server(tmp_path):
    dest = tmp_path / "file.bin"
    with pytest.raises(DataError) as excinfo:
        download_file(f"http://127.0.0.1:{unused_port()}/file.bin", dest, md5=PAYLOAD_MD5, timeout=5)
    message = str(excinfo.value)
    assert "\n" not in message and "download failed" in message and "file.bin" in message
    assert list(tmp_path.iterdir()) == []


def test_http_404(server, tmp_path):
    url, _, _ = server
    with pytest.raises(DataError) as excinfo:
        download_file(url + "absent.bin", tmp_path / "absent.bin", md5=PAYLOAD_MD5)
    assert "404" in str(excinfo.value)
    assert list(tmp_path.glob("*absent*")) == []


def test_ensure_dataset_files_downloads_only_missing(server, tmp_path, monkeypatch):
    url, served, requests = server
    files = {"a.gz": b"alpha" * 100, "b.gz": b"beta" * 100}
    for name, data in files.items():
        (served / name).write_bytes(data)
    md5s = {name: hashlib.md5(data).hexdigest() for name, data in files.items()}
    monkeypatch.setitem(SOURCES, "tiny", DatasetSource(mirror="http://unused.invalid/", md5_by_file=md5s))
    folder = tmp_path / "cache" / "tiny"
    folder.mkdir(parents=True)
    (folder / "a.gz").write_bytes(files["a.gz"])
    assert ensure_dataset_files("tiny", folder, base_url=url.rstrip("/")) == folder
    assert requests == ["/b.gz"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    ensure_dataset_files("tiny", folder, base_url=url)
    assert requests == ["/b.gz"]


def test_ensure_real_source_rejects_wrong_bytes(server, tmp_path):
    url, served, _ = server
    for name in SOURCES["mnist"].md5_by_file:
        (served / name).write_bytes(b"not mnist")
    with pytest.raises(DataError) as excinfo:
        ensure_dataset_files("mnist", tmp_path, base_url=url)
    assert "checksum mismatch" in str(excinfo.value)
    assert list(tmp_path.iterdir()) == [tmp_path / "served"]


def test_unknown_dataset_name(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        ensure_dataset_files("imagenet", tmp_path)
    assert "mnist" in str(excinfo.value)


def test_sources_are_well_formed():
    assert set(SOURCES) >= {"mnist", "fashion-mnist", "cifar10"}
    for source in SOURCES.values():
        assert source.mirror.endswith("/")
        for md5 in source.md5_by_file.values():
            assert len(md5) == 32 and set(md5) <= set("0123456789abcdef")
    # what is downloaded is exactly what the readers look for
    idx_files = {
        f"{p}-{k}-idx{n}-ubyte.gz" for p in ("train", "t10k") for k, n in (("images", 3), ("labels", 1))
    }
    assert set(SOURCES["mnist"].md5_by_file) == idx_files == set(SOURCES["fashion-mnist"].md5_by_file)
    assert set(SOURCES["cifar10"].md5_by_file) == {"cifar-10-binary.tar.gz"}


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "polytrain" / "datasets"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "polytrain" / "datasets"


def test_file_md5_matches_hashlib(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(PAYLOAD * 100)
    assert download.file_md5(path) == hashlib.md5(PAYLOAD * 100).hexdigest()
