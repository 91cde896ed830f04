"""A stand-in for the Hugging Face hub on 127.0.0.1, for the hub download tests (checkpoint/test_hub,
checkpoint/test_hub_partial_download; the ``hub`` fixture in checkpoint/conftest.py serves it).

The stand-in implements only what ``snapshot_download`` calls: the revision info (``/api/models/<id>/revision/<rev>``),
the recursive tree listing (``/api/models/<id>/tree/<commit>``) and ``HEAD``/``GET /<id>/resolve/<rev>/<file>`` with
the headers the client reads (X-Repo-Commit, ETag, Content-Length), and answers errors the way the hub does
(X-Error-Code: RepoNotFound / GatedRepo / RevisionNotFound; 401 with "Invalid credentials..."; 403). It serves
``FILES`` as org/model (a test may swap the table). Each case runs in a fresh interpreter, because huggingface_hub
reads HF_ENDPOINT and HF_HOME when it is imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import unquote, urlsplit

import torch
from safetensors.torch import save

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MAX_REQUESTS = 200  # bounded: a client that loops gets 500s, and the test sees it in the request count


def _repo_files() -> dict[str, bytes]:
    """A small model repo with files plate-inspect must fetch (safetensors, json) and files it must not."""
    weights = save({"model.layers.0.mlp.up_proj.weight": torch.arange(12, dtype=torch.float32).reshape(4, 3)})
    return {
        "model.safetensors": weights,
        "config.json": json.dumps({"model_type": "llama"}).encode(),
        "README.md": b"# a model card\n",
        "pytorch_model.bin": b"pickle bytes that must never be downloaded",
        "tokenizer.model": b"sentencepiece bytes",
    }


FILES = _repo_files()


class StandInHub(BaseHTTPRequestHandler):
    """Answers like the hub for repos org/model (public), org/gated, org/private, org/forbidden; others 404."""

    requests: list[tuple[str, str]] = []

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data: object) -> None:
        self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def _error(self, status: int, code: str | None = None, message: str | None = None) -> None:
        headers = {"X-Error-Code": code} if code else {}
        if message:
            headers["X-Error-Message"] = message
        self._send(status, json.dumps({"error": message or code or "error"}).encode(), headers)

    def _route(self) -> None:
        path = unquote(urlsplit(self.path).path)
        self.requests.append((self.command, path))
        if len(self.requests) > MAX_REQUESTS:
            return self._error(500, message="too many requests")
        token = self.headers.get("Authorization")
        parts = path.strip("/").split("/")
        api = parts[:2] == ["api", "models"]
        repo = "/".join(parts[2:4] if api else parts[0:2])
        if repo == "org/private":
            if token:
                return self._error(401, message="Invalid credentials in Authorization header")
            return self._error(401, "RepoNotFound")  # the hub hides private repos from anonymous callers
        if repo == "org/forbidden":
            return self._error(403, message="Your token does not have access to this repository")
        if repo not in ("org/model", "org/gated"):
            return self._error(404, "RepoNotFound")
        if api and parts[4:5] == ["revision"]:
            if parts[5] not in ("main", COMMIT):
                return self._error(404, "RevisionNotFound")
            siblings = [{"rfilename": name} for name in FILES]
            return self._json({"id": repo, "sha": COMMIT, "siblings": siblings, "gated": repo == "org/gated"})
        if api and parts[4:5] == ["tree"]:
            if parts[5] != COMMIT:
                return self._error(404, "RevisionNotFound")
            listing = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in FILES.items()
            ]
            return self._json(listing)
        if parts[2:3] == ["resolve"] and len(parts) >= 5:
            if repo == "org/gated":
                return self._error(403, "GatedRepo", "Access to model org/gated is restricted")
            if parts[3] not in ("main", COMMIT):
                return self._error(404, "RevisionNotFound")
            name = "/".join(parts[4:])
            if name not in FILES:
                return self._error(404, "EntryNotFound")
            data = FILES[name]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            return self._send(200, data, headers)
        return self._error(404)

    do_GET = do_HEAD = do_POST = _route


_SCRIPT = """
import json, sys
from plate_inspect.checkpoint import Checkpoint
out = []
for repo, revision, offline in json.loads(sys.argv[1]):
    try:
        ckpt = Checkpoint.open(repo, revision=revision, offline=offline)
        w, _ = ckpt.read_weight("model.layers.0.mlp.up_proj.weight")
        files = sorted(p.name for p in ckpt.root.iterdir())
        out.append({"ok": True, "commit": ckpt.source.commit, "files": files, "sum": float(w.sum())})
    except Exception as e:
        from plate_inspect.errors import PlateInspectError
        out.append({"ok": False, "type": type(e).__name__, "ours": isinstance(e, PlateInspectError), "message": str(e)})
print(json.dumps(out))
"""


def open_in_fresh_process(
    cases: list[tuple], home: Path, endpoint: str, token: str | None = None, extra_env: dict[str, str] | None = None
) -> list[dict]:
    """Checkpoint.open for each (repo, revision, offline) in a new interpreter pointed at the stand-in hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING")) and "proxy" not in k.lower()}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(home),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        HF_HUB_ETAG_TIMEOUT="5",
        HF_HUB_DOWNLOAD_TIMEOUT="5",
        NO_PROXY="127.0.0.1,localhost",
    )
    if token:
        env["HF_TOKEN"] = token
    env.update(extra_env or {})
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def endpoint_of(server) -> str:
    """The stand-in server's address as an HF_ENDPOINT."""
    host, port = server.server_address[:2]
    assert host == "127.0.0.1"
    return f"http://{host}:{port}"
