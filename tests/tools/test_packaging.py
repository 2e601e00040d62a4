"""`pip install .` gives a working pooling-server that needs no pooling-client.

Installing every dependency from the registry would fetch torch (gigabytes), so the fresh
environment reaches this project's virtualenv for its dependencies through a .pth path
entry (which activates none of that environment's editable installs) and installs the
server's own wheel with --no-deps. The wheel must carry its own generated protobuf code,
declare no dependency on the client package, and run a real server that answers.
"""

from __future__ import annotations

import os
import re
import signal
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import grpc
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.server_process import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
import pooling_server.service.cli, pooling_server.service.launch, pooling_server.service.server
import pooling_server.service.grpc.servicer, pooling_server.service.http.app
leaked = [m for m in sys.modules if m.split(".")[0] == "pooling_client"]
sys.exit(f"the server imported the client package: {leaked}" if leaked else 0)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*build, "--wheel-dir", str(out), str(ROOT)],
        check=True,
        timeout=600,
    )
    [built] = out.glob("pooling_server-*.whl")
    return built


def test_wheel_carries_its_protobuf_code_and_no_client_dependency(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = re.findall(
            r"^Requires-Dist: ([A-Za-z0-9_.-]+)", archive.read(metadata).decode(), re.M
        )
    assert "pooling_server/service/proto/pooling_pb2.py" in names
    assert "pooling_server/service/proto/pooling_pb2_grpc.py" in names
    # One import root of our own: no generic top-level name such as `service` or `engine`.
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"pooling_server"}, tops
    assert not [n for n in names if n.startswith("pooling_client/")]
    normalized = {name.lower().replace("_", "-") for name in requires}
    assert "pooling-client" not in normalized
    pinned = {
        line.split("==")[0].split("[")[0].strip().lower().replace("_", "-")
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    assert normalized <= pinned, f"dependencies without a pin: {normalized - pinned}"


def test_installed_wheel_serves_without_the_client(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "server-venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    target_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Dependencies from this project's environment, without its editable installs.
    Path(target_site, "project-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=600,
    )
    probe = subprocess.run([str(python), "-c", "import pooling_client"], capture_output=True)
    assert probe.returncode != 0, "the client package must not be importable here"
    check = subprocess.run(
        [str(python), "-c", CHECK], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # A user's own `service` and `engine` modules (a Ray worker's project, say) stay theirs.
    project = tmp_path / "user-project"
    project.mkdir()
    (project / "service.py").write_text("WHOSE = 'user'\n")
    (project / "engine.py").write_text("WHOSE = 'user'\n")
    both = (
        "import service, engine, pooling_server.service.launch; print(service.WHOSE, engine.WHOSE)"
    )
    mixed = subprocess.run(
        [str(python), "-c", both], capture_output=True, text=True, timeout=120, cwd=project
    )
    assert mixed.returncode == 0 and mixed.stdout.split() == ["user", "user"], mixed.stderr

    port = free_port()
    log_path = tmp_path / "installed-server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(env_dir / "bin" / "pooling-server"), "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    server = ServerProcess(process, port, log_path)
    try:
        server.wait_serving()
        with grpc.insecure_channel(server.address) as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            response = stub.Pool(
                pb.PoolRequest(embed=pb.TextInput(texts=["installed"])), timeout=60
            )
        assert len(response.embed.embeddings[0].values) == 384
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()


def test_the_code_imports_its_folders_by_the_import_root_only() -> None:
    """Run from the repository, `engine` and `service` would also import as top-level
    packages: a second copy of every module, whose errors and classes are not the first's.
    Every import names them under `pooling_server`."""
    bare = re.compile(
        r"^\s*(?:from\s+(?:engine|service)[\w.]*\s+import\b|import\s+(?:engine|service)[\w.]*\s*(?:$|,|as\b))",
        re.M,
    )
    found = [
        str(path.relative_to(ROOT))
        for folder in ("engine", "service", "tests", "benchmarks", "scripts", "pooling_server")
        for path in (ROOT / folder).rglob("*.py")
        if bare.search(path.read_text())
    ]
    assert not found, found
