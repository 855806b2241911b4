"""gateway/gateway.yaml, the example config the README points to: every section and field is
there with a comment, it passes the same loading and validation start-up runs (gateway.config),
and a gateway really starts from it. The README's shell walkthrough writes its credentials outside
the repository, and .gitignore covers them anyway."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from loadtests.processes import stop_processes
from gateway.config import GatewayConfig, check_files, load_config
from tests.conftest import REPO, free_port

EXAMPLE = REPO / "gateway" / "gateway.yaml"
README = REPO / "README.md"


def _fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _fields(type(default), prefix + f.name + ".")


def test_example_has_every_section_and_field_with_a_comment():
    text = EXAMPLE.read_text()
    data = yaml.safe_load(text)
    sections = [f.name for f in dataclasses.fields(GatewayConfig)]
    assert list(data) == sections  # every section, in the dataclass order
    for path, _f in _fields(GatewayConfig):
        node = data
        for part in path.split("."):
            assert isinstance(node, dict) and part in node, f"{path} missing from {EXAMPLE.name}"
            node = node[part]
    for no, line in enumerate(text.splitlines(), 1):
        if re.match(r"^\s+[a-z_0-9]+:", line) and not line.strip().startswith("- "):
            assert "#" in line, f"{EXAMPLE.name}:{no} has no comment: {line.strip()}"


def _credentials(where: Path) -> None:
    (where / "keys.yaml").write_text("t0: [sk-example-test-key]\n")
    (where / "salt.secret").write_text("example-test-salt-secret-0123456789abcdef\n")


def test_example_loads_and_validates_as_start_up_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _credentials(tmp_path)
    cfg = load_config(str(EXAMPLE), env={})
    check_files(cfg)
    from gateway.server import build_authenticator

    build_authenticator(cfg)  # the keys file parses
    assert cfg.policy.name == "cache_aware" and cfg.policy.params["w_cache"] == 2.0
    assert [r.id for r in cfg.membership.replicas] == ["r1", "r2"] and cfg.auth.enabled
    # the CLI's own check, from a directory holding the referenced files
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "gateway", "--check-config", str(EXAMPLE)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_gateway_starts_from_the_example(tmp_path, redis_server):
    _credentials(tmp_path)
    port, admin = free_port(), free_port()
    env = {**os.environ, "WARMROUTE_SERVER__PORT": str(port), "WARMROUTE_SERVER__ADMIN_PORT": str(admin),
           "WARMROUTE_SERVER__HOST": "127.0.0.1", "WARMROUTE_FEED__URL": redis_server.url}
    log = tmp_path / "gateway.log"
    with log.open("wb") as fh:
        p = subprocess.Popen([sys.executable, "-m", "gateway.cli", "gateway", "--config", str(EXAMPLE)], cwd=tmp_path,
                             env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            except urllib.error.HTTPError as e:
                assert e.code == 401 and json.loads(e.read())["error"]["code"] == "missing_api_key"
                break
            except OSError:
                assert p.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                     headers={"Authorization": "Bearer sk-example-test-key"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.loads(r.read())["data"][0]["id"] == "warmroute-sim"  # model.name from the file
    finally:
        stop_processes([p], 30)
    assert p.returncode == 0, log.read_text()[-3000:]


def test_readme_points_to_the_example():
    text = README.read_text()
    assert "gateway/gateway.yaml" in text and "--config gateway/gateway.yaml" in text


def _walkthrough() -> str:
    text = README.read_text()
    section = text.split("## Running a whole system from a shell", 1)[1].split("\n## ", 1)[0]
    return section.split("```bash", 1)[1].split("```", 1)[0]


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


def test_readme_walkthrough_writes_no_secret_into_the_repository():
    block = _walkthrough()
    writers = [ln for ln in block.splitlines() if re.search(r"(?<![-=])>\s*\S", ln) and not ln.lstrip().startswith("#")]
    assert writers, "the walkthrough creates its credentials somewhere"
    for ln in writers:
        for target in re.findall(r"(?<![-=])>\s*(\"[^\"]+\"|\S+)", ln):
            assert target.strip('"').startswith("$WR/"), f"writes {target} relative to the working directory: {ln}"
    before = _git_status()
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(writers) + '\necho "$WR"'], cwd=REPO,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    wr = Path(r.stdout.strip().splitlines()[-1])
    try:
        assert (wr / "keys.yaml").is_file() and (wr / "salt.secret").is_file()
        assert not wr.resolve().is_relative_to(REPO)
        assert _git_status() == before  # nothing new in the repository
    finally:
        shutil.rmtree(wr, ignore_errors=True)


def test_gitignore_covers_credentials_anyway():
    for name in ("keys.yaml", "salt.secret", "gateway/keys.yaml", "deploy/jwt.secret"):
        r = subprocess.run(["git", "check-ignore", "-q", "--no-index", name], cwd=REPO)
        assert r.returncode == 0, f"{name} is not ignored"
    r = subprocess.run(["git", "check-ignore", "-q", "--no-index", "gateway/gateway.yaml"], cwd=REPO)
    assert r.returncode == 1  # the example itself is tracked
