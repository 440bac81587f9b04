"""scripts/fetch_assets.py against a server on the loopback: plain URLs (checksums, a cut download
that resumes with a Range request, a 404) and the hub client pointed at the same server."""
from __future__ import annotations

import hashlib
import http.server
import threading
from pathlib import Path

import pytest
from helpers import ROOT, load_script

from ancre_dit.assets import ASSETS, Asset, fetch_all, format_listing
from ancre_dit.assets.download import git_blob_sha1
from ancre_dit.errors import UserError

WEIGHTS = bytes(range(256)) * 4096  # 1 MiB
CONFIG = b'{"scaling_factor": 0.18215}\n'
COMMIT = "a" * 40


class Server(http.server.ThreadingHTTPServer):
    """Serves `files` by path; `cut_once`: paths whose first GET stops halfway; records every request."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.files: dict[str, bytes] = {}
        self.cut_once: set[str] = set()
        self.wrong_etag: set[str] = set()  # paths whose ETag is not their content's hash
        self.requests: list[tuple[str, str, str | None]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, head: bool) -> None:
        server: Server = self.server
        server.requests.append((self.command, self.path, self.headers.get("Range")))
        data = server.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        start = int(self.headers["Range"].split("=")[1].rstrip("-")) if self.headers.get("Range") else 0
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        if "/resolve/" in self.path:  # the hub's headers: the commit, and the file's hash as its ETag
            lfs = self.path.endswith(".safetensors")
            etag = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            if self.path in server.wrong_etag:
                etag = hashlib.sha256(b"another file").hexdigest()
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{etag}"')
        self.end_headers()
        if head:
            return
        body = data[start:]
        if self.path in server.cut_once and not start:
            server.cut_once.discard(self.path)
            body = body[: len(body) // 2]
            self.wfile.write(body)
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def do_GET(self):
        self._send(head=False)

    def do_HEAD(self):
        self._send(head=True)


@pytest.fixture
def server():
    s = Server()
    thread = threading.Thread(target=s.serve_forever, daemon=True)
    thread.start()
    yield s
    s.shutdown()
    s.server_close()


def _url_asset(server: Server, **kwargs) -> Asset:
    return Asset("weights", "test weights", ("eval.inception_weights={path}",), url=f"{server.url}/files/w.pth",
                 **kwargs)


def test_a_plain_file_is_fetched_verified_and_pointed_at(server, tmp_path, capsys):
    server.files["/files/w.pth"] = WEIGHTS
    asset = _url_asset(server, sha256={"w.pth": hashlib.sha256(WEIGHTS).hexdigest()})
    fetched = fetch_all(tmp_path / "assets", assets={"weights": asset})
    path = tmp_path / "assets" / "weights" / "w.pth"
    assert fetched == {"weights": [path]} and path.read_bytes() == WEIGHTS
    assert f"eval.inception_weights={path}" in capsys.readouterr().out
    gets = len(server.requests)
    fetch_all(tmp_path / "assets", assets={"weights": asset})  # already there: verified, not fetched again
    assert len(server.requests) == gets


def test_a_checksum_mismatch_removes_the_file_and_says_so(server, tmp_path):
    server.files["/files/w.pth"] = WEIGHTS
    asset = _url_asset(server, sha256={"w.pth": "0" * 64})
    with pytest.raises(UserError, match=r"w\.pth has SHA-256 [0-9a-f]{64}, expected 0{64}: the download is damaged"):
        fetch_all(tmp_path, assets={"weights": asset})
    assert not (tmp_path / "weights" / "w.pth").exists()
    prefixed = _url_asset(server, hash_prefix="ffffffff")  # torch.hub's convention: the digest's first digits
    with pytest.raises(UserError, match="expected ffffffff..."):
        fetch_all(tmp_path, assets={"weights": prefixed})


def test_a_cut_download_resumes_where_it_stopped(server, tmp_path):
    server.files["/files/w.pth"] = WEIGHTS
    server.cut_once.add("/files/w.pth")
    asset = _url_asset(server, hash_prefix=hashlib.sha256(WEIGHTS).hexdigest()[:8])
    with pytest.raises(UserError, match="rerun the same command to resume"):
        fetch_all(tmp_path, assets={"weights": asset})
    part = tmp_path / "weights" / "w.pth.part"
    arrived = part.stat().st_size
    assert part.is_file() and 0 < arrived < len(WEIGHTS)
    fetch_all(tmp_path, assets={"weights": asset})
    assert (tmp_path / "weights" / "w.pth").read_bytes() == WEIGHTS and not part.exists()
    assert server.requests[-1] == ("GET", "/files/w.pth", f"bytes={arrived}-")


def test_a_missing_file_is_one_line_naming_it(server, tmp_path):
    with pytest.raises(UserError, match=r"/files/w\.pth was not found \(HTTP 404\)"):
        fetch_all(tmp_path, assets={"weights": _url_asset(server)})


def test_an_unpublished_checksum_is_recorded_then_checked(server, tmp_path):
    server.files["/files/w.pth"] = WEIGHTS
    asset = _url_asset(server)
    fetch_all(tmp_path, assets={"weights": asset})
    (tmp_path / "weights" / "w.pth").write_bytes(WEIGHTS[:-1] + b"x")  # damaged on disk since
    with pytest.raises(UserError, match="the download is damaged"):
        fetch_all(tmp_path, assets={"weights": asset})


def test_the_hub_client_fetches_from_the_server_and_checks_both_hashes(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    server.files["/org/vae/resolve/main/config.json"] = CONFIG
    server.files["/org/vae/resolve/main/diffusion_pytorch_model.safetensors"] = WEIGHTS
    asset = Asset("vae", "a VAE", ("data.vae={path}",), repo="org/vae",
                  files=("config.json", "diffusion_pytorch_model.safetensors"))
    fetched = fetch_all(tmp_path / "assets", assets={"vae": asset}, endpoint=server.url)
    folder = tmp_path / "assets" / "vae"
    assert [p.read_bytes() for p in fetched["vae"]] == [CONFIG, WEIGHTS]
    assert git_blob_sha1(folder / "config.json") == hashlib.sha1(b"blob %d\0" % len(CONFIG) + CONFIG).hexdigest()
    assert f"data.vae={folder}" in capsys.readouterr().out
    server.files["/org/bad/resolve/main/model.safetensors"] = WEIGHTS
    server.wrong_etag.add("/org/bad/resolve/main/model.safetensors")
    bad = Asset("bad", "x", (), repo="org/bad", files=("model.safetensors",))
    with pytest.raises(UserError, match="model.safetensors has SHA-256 .* the download is damaged"):
        fetch_all(tmp_path / "assets", assets={"bad": bad}, endpoint=server.url)
    assert not (tmp_path / "assets" / "bad" / "model.safetensors").exists()
    with pytest.raises(UserError, match="org/nothing/config.json .* was not found on the hub"):
        fetch_all(tmp_path / "assets", assets={"x": Asset("x", "x", (), repo="org/nothing", files=("config.json",))},
                  endpoint=server.url)


def test_list_prints_every_asset_and_downloads_nothing(capsys):
    load_script(ROOT / "scripts" / "fetch_assets.py").main(["--list"])
    listing = capsys.readouterr().out
    assert listing.strip() == format_listing().strip()
    for asset in ASSETS.values():
        assert f"{asset.name}: " in listing and all(name in listing for name in asset.file_names)
    assert "sha256 starting 6726825d" in listing


def test_an_unknown_name_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(UserError, match="unknown asset nope; choose from inception"):
        fetch_all(tmp_path / "assets", ["nope"])
    assert not (tmp_path / "assets").exists()


def test_a_hub_file_with_a_published_checksum_is_fetched_and_checked_against_it(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    server.files["/org/w/resolve/main/model.safetensors"] = WEIGHTS
    pinned = Asset("w", "x", (), repo="org/w", files=("model.safetensors",),
                   sha256={"model.safetensors": hashlib.sha256(WEIGHTS).hexdigest()})
    (path,) = fetch_all(tmp_path / "assets", assets={"w": pinned}, endpoint=server.url)["w"]
    assert path.read_bytes() == WEIGHTS
    wrong = Asset("v", "x", (), repo="org/w", files=("model.safetensors",), sha256={"model.safetensors": "0" * 64})
    with pytest.raises(UserError, match="expected 0{64}: the download is damaged"):
        fetch_all(tmp_path / "assets", assets={"v": wrong}, endpoint=server.url)
