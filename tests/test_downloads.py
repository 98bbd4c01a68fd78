"""Plain-URL downloads against a real HTTP server on 127.0.0.1 that misbehaves on purpose.

Each fault the issue names (server stopped mid-file, 500 and 503 answers, a truncated file, a
wrong checksum, a server too slow to answer) is injected for the first attempts of a
request; the download must then end in a correct file, or, when the fault persists, in one
:class:`MissingResourceError` naming the URL and the path to fill, with nothing left behind
that a rerun would trust. A rerun against a healthy server completes.
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kpca_repro.inputs.resources import (
    HUB_TIMEOUT_VARIABLES,
    DownloadPolicy,
    MissingResourceError,
    content_sha256,
    download_imagenet_sample,
    download_wandb_logs,
    export_hub_timeouts,
    fetch_url,
)

FAST = DownloadPolicy(retries=2, backoff_s=0.0, timeout_s=2.0)
PAYLOAD = bytes(range(256)) * 4096  # 1 MiB, not compressible to nothing, distinct bytes
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()


class FaultyServer:
    """A threaded HTTP server whose answers follow, per path, a list of behaviours consumed one
    request at a time (then ``ok`` for ever): ``ok``, ``500``, ``503``, ``cut`` (Content-Length
    of the whole file, half of it sent, connection closed: the server stopped mid-file),
    ``short`` (half the file without Content-Length: a truncated file), ``wrong`` (other bytes
    of the same length: a wrong checksum), ``slow`` (no answer for longer than the client's
    timeout)."""

    def __init__(self, files: dict[str, bytes]):
        self.files = dict(files)
        self.plan: dict[str, list[str]] = {}
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest's output clean
                pass

            def do_GET(self):
                path = self.path.split("?")[0]
                server.requests.append(path)
                body = server.files.get(path)
                plan = server.plan.get(path) or []
                action = plan.pop(0) if plan else "ok"
                if body is None:
                    self.send_error(404)
                    return
                if action in ("500", "503"):
                    self.send_error(int(action))
                    return
                if action == "slow":
                    time.sleep(FAST.timeout_s + 1.5)
                    self.close_connection = True
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                if action == "short":
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(body[: len(body) // 2])
                    self.close_connection = True
                    return
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if action == "cut":
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(bytes(255 - b for b in body) if action == "wrong" else body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    with FaultyServer({"/data.bin": PAYLOAD}) as s:
        yield s


def _leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


@pytest.mark.parametrize("fault", ["500", "503", "cut", "short", "wrong", "slow"])
def test_each_fault_is_retried_into_a_correct_file(server, tmp_path, caplog, fault):
    server.plan["/data.bin"] = [fault, fault]
    dest = tmp_path / "out" / "data.bin"
    with caplog.at_level(logging.WARNING):
        fetch_url(f"{server.url}/data.bin", dest, f"sha256:{PAYLOAD_SHA}", what="test data", how="Copy it by hand.", policy=FAST)
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == PAYLOAD_SHA
    retry_lines = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retry_lines) == 2 and all(f"{server.url}/data.bin" in r.getMessage() for r in retry_lines)
    assert len(server.requests) == 3
    assert _leftovers(dest.parent, {"data.bin"}) == []


@pytest.mark.parametrize("fault", ["503", "cut", "short", "wrong", "slow"])
def test_a_persistent_fault_ends_in_one_clear_error_and_leaves_nothing(server, tmp_path, fault):
    server.plan["/data.bin"] = [fault] * 3
    dest = tmp_path / "out" / "data.bin"
    with pytest.raises(MissingResourceError) as err:
        fetch_url(f"{server.url}/data.bin", dest, PAYLOAD_SHA, what="test data", how="Copy it by hand.", policy=FAST)
    message = str(err.value)
    assert f"{server.url}/data.bin" in message and str(dest) in message and "failed 3 times" in message and "Copy it by hand." in message
    assert not dest.exists() and _leftovers(dest.parent, set()) == []
    # the rerun, once the server behaves, completes
    fetch_url(f"{server.url}/data.bin", dest, PAYLOAD_SHA, what="test data", how="", policy=FAST)
    assert dest.read_bytes() == PAYLOAD


def test_a_complete_file_is_not_fetched_again_and_a_corrupt_one_is_replaced(server, tmp_path):
    dest = tmp_path / "data.bin"
    fetch_url(f"{server.url}/data.bin", dest, PAYLOAD_SHA, what="test data", how="", policy=FAST)
    fetch_url(f"{server.url}/data.bin", dest, PAYLOAD_SHA, what="test data", how="", policy=FAST)
    assert len(server.requests) == 1
    dest.write_bytes(PAYLOAD[:100])  # a file a rerun must not trust
    fetch_url(f"{server.url}/data.bin", dest, PAYLOAD_SHA, what="test data", how="", policy=FAST)
    assert len(server.requests) == 2 and dest.read_bytes() == PAYLOAD


def _jpeg_like(i: int) -> bytes:
    return b"\xff\xd8\xff" + hashlib.sha256(str(i).encode()).digest() * 50


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


def test_imagenet_sample_archive_checked_by_its_digest_and_its_images(tmp_path):
    images = {f"n0000000{i}_thing{i}.JPEG": _jpeg_like(i) for i in range(3)}
    good = _zip({f"sample-abc/{k}": v for k, v in images.items()} | {"sample-abc/README.md": b"x"})
    bad = _zip({f"sample-abc/{k}": (v if i else b"changed") for i, (k, v) in enumerate(images.items())})
    lines = sorted(f"{k} {hashlib.sha256(v).hexdigest()}\n" for k, v in images.items())
    digest = hashlib.sha256("".join(lines).encode()).hexdigest()
    out = tmp_path / "res" / "images" / "imagenet-sample"
    with FaultyServer({"/good.zip": good, "/bad.zip": bad}) as s:
        s.plan["/good.zip"] = ["cut"]
        kwargs = dict(expected_count=3, archive_sha256=hashlib.sha256(good).hexdigest(), content_sha256_expected=digest, policy=FAST)
        with pytest.raises(MissingResourceError, match="content digest"):
            download_imagenet_sample(f"{s.url}/bad.zip", out, **{**kwargs, "archive_sha256": None})
        assert not out.exists() and _leftovers(out.parent, set()) == []
        with pytest.raises(MissingResourceError, match="failed 3 times"):
            download_imagenet_sample(f"{s.url}/bad.zip", out, **kwargs)  # not the pinned archive
        assert not out.exists() and _leftovers(out.parent, set()) == []
        download_imagenet_sample(f"{s.url}/good.zip", out, **kwargs)
    assert sorted(p.name for p in out.iterdir()) == sorted(images)
    assert content_sha256(out.iterdir()) == digest
    assert _leftovers(out.parent, {"imagenet-sample"}) == []


def test_wandb_logs_all_or_nothing(tmp_path):
    files = {"vit_tiny": ["a.csv", "b.csv"], "deit_tiny": ["c.csv"]}
    served = {f"/wandb/{m}/{f}": f"{m},{f}\n".encode() for m, names in files.items() for f in names}
    hashes = {k.removeprefix("/wandb/"): hashlib.sha256(v).hexdigest() for k, v in served.items()}
    out = tmp_path / "training_logs"
    with FaultyServer(served) as s:
        s.plan["/wandb/deit_tiny/c.csv"] = ["wrong"] * 3
        with pytest.raises(MissingResourceError, match="deit_tiny/c.csv"):
            download_wandb_logs(f"{s.url}/wandb", out, files, hashes, policy=FAST)
        assert not out.exists() and _leftovers(tmp_path, set()) == []
        download_wandb_logs(f"{s.url}/wandb/", out, files, hashes, policy=FAST)
    assert {str(p.relative_to(out)) for p in out.rglob("*.csv")} == set(hashes)


def test_hub_timeouts_follow_the_configuration_and_keep_a_users_export():
    """downloads.timeout_s reaches huggingface_hub through the variables it reads (its own
    default, 10 s, would otherwise apply to hub files); seconds round up; an export wins."""
    env = {}
    assert export_hub_timeouts(7.2, env) == {name: "8" for name in HUB_TIMEOUT_VARIABLES}
    assert env == {name: "8" for name in HUB_TIMEOUT_VARIABLES}
    mine = {"HF_HUB_DOWNLOAD_TIMEOUT": "300"}
    export_hub_timeouts(60, mine)
    assert mine == {"HF_HUB_DOWNLOAD_TIMEOUT": "300", "HF_HUB_ETAG_TIMEOUT": "60"}


def test_huggingface_hub_reads_the_exported_timeouts():
    """The names are the ones huggingface_hub really reads: a fresh interpreter (as a job is)
    with the exported environment has them as its download and metadata timeouts."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in HUB_TIMEOUT_VARIABLES}
    export_hub_timeouts(37, env)
    code = "from huggingface_hub import constants as c; print(c.HF_HUB_DOWNLOAD_TIMEOUT, c.HF_HUB_ETAG_TIMEOUT)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["37", "37"]


def test_the_download_command_explains_itself(capsys):
    """`python -m kpca_repro.inputs.download --help` (named in docs/running.md) prints its usage, no
    traceback; an unknown kind is refused by argparse with the kinds it knows (status 2)."""
    from kpca_repro.inputs import download

    with pytest.raises(SystemExit) as done:
        download.parse_args(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: python -m kpca_repro.inputs.download") and all(k in out for k in download.KINDS)
    with pytest.raises(SystemExit) as done:
        download.parse_args(["foo", "log", "{}", "-", "out"])
    assert done.value.code == 2 and "invalid choice: 'foo'" in capsys.readouterr().err
    args = download.parse_args(["fashion_mnist", "l.log", "{}", "-", "a.gz", "b.gz"])
    assert (args.kind, args.arg, args.output) == ("fashion_mnist", "-", ["a.gz", "b.gz"])
