"""What an engine must answer to ``POST /weights_checker {"action": "checksum"}`` once it serves a
version, computed by the trainer from the version it sent (docs/design.md section 8, proof).

SGLang 0.5.23 hashes the parameters *it* holds (``sglang/srt/utils/weight_checker.py``): each
tensor of ``named_parameters()`` and ``named_buffers()`` but the rotary caches, as the first 8
bytes of the sha256 of its raw bytes (``tensor_hash``, CPU tensors), written ``%016x``; the
engine's checksum is the sha256 of ``name`` + hash over the names in sorted order, and the
answer's ``per_engine_checksum`` the sha256 of each TP rank's checksum. The engine holds its
own layout, not the checkpoint's: a Llama-family model fuses ``q_proj, k_proj, v_proj`` into
``qkv_proj`` and ``gate_proj, up_proj`` into ``gate_up_proj`` (rows concatenated in that order,
one TP rank), pads the vocabulary rows of ``embed_tokens`` and ``lm_head`` with zeros to a
multiple of 64 (``VocabParallelEmbedding``), in the engine's dtype. ``engine_layout`` rebuilds
that layout from the version's HF tensors, so the trainer applies SGLang's own hashing to what a
correct engine holds: an engine that answers anything else serves other weights than the version its label names.

Checked for one TP rank on the CPU. A CUDA engine hashes with a Triton kernel, which this module
does not reproduce: there the proof is left to comparing the engines' checksums with one another
(docs/design.md section 8, not done yet).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

import aiohttp
import orjson
import torch

log = logging.getLogger("centerline.trainer.proof")

FUSED = {  # checkpoint suffix -> (engine suffix, position in the fused rows)
    ".q_proj.weight": (".qkv_proj.weight", 0),
    ".k_proj.weight": (".qkv_proj.weight", 1),
    ".v_proj.weight": (".qkv_proj.weight", 2),
    ".q_proj.bias": (".qkv_proj.bias", 0),
    ".k_proj.bias": (".qkv_proj.bias", 1),
    ".v_proj.bias": (".qkv_proj.bias", 2),
    ".gate_proj.weight": (".gate_up_proj.weight", 0),
    ".up_proj.weight": (".gate_up_proj.weight", 1),
}
UNTRUSTED = "unverified"  # the label of an engine caught: not a version, so no sample of it is trained
VOCAB = (".embed_tokens.weight", "lm_head.weight")  # rows padded to VOCAB_PADDING
VOCAB_PADDING = 64  # sglang/srt/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE


class WeightProofError(RuntimeError):
    """An engine's weights are not the version its label names, or cannot be asked."""


def engine_layout(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors an engine holds after loading ``tensors`` (HF names) in ``dtype``."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        for suffix, (fused, index) in FUSED.items():
            if name.endswith(suffix):
                parts.setdefault(name[: -len(suffix)] + fused, {})[index] = tensor
                break
        else:
            if name.endswith(VOCAB):
                rows = -(-tensor.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
                tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
            out[name] = tensor.to(dtype)
    for name, pieces in parts.items():
        out[name] = torch.cat([pieces[i] for i in sorted(pieces)], dim=0).to(dtype)
    return out


def tensor_hash(tensor: torch.Tensor) -> str:
    """SGLang's per-tensor hash of a CPU tensor (``sglang.srt.managers.mm_utils.tensor_hash``)."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).digest()[:8].hex()


def checksums(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, str]:
    """Per-tensor hashes of the engine's layout of ``tensors``."""
    return {name: tensor_hash(t) for name, t in engine_layout(tensors, dtype).items()}


def engine_checksum(per_tensor: dict[str, str]) -> str:
    """``per_engine_checksum`` of a one-rank engine holding tensors hashed ``per_tensor``."""
    rank = hashlib.sha256()
    for name in sorted(per_tensor):
        rank.update(name.encode())
        rank.update(per_tensor[name].encode())
    return hashlib.sha256(rank.hexdigest().encode()).hexdigest()


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the HF directory ``path`` (its ``*.safetensors``), on the CPU."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return tensors


def differing(expected: dict[str, str], reply: dict) -> list[str]:
    """The tensor names whose hash in the engine's ``/weights_checker`` ``reply`` differs from
    ``expected`` (missing on either side counts); empty when every tensor agrees."""
    ranks = reply.get("ranks") or []
    if len(ranks) != 1:
        raise WeightProofError(f"/weights_checker answered {len(ranks)} ranks; proof covers one TP rank")
    held = ranks[0].get("checksums") or {}
    return sorted(n for n in expected.keys() | held.keys() if expected.get(n) != held.get(n))


class Prover:
    """Proves engines' weights: ``post(url, endpoint, body)`` and ``get(url, endpoint)`` are the
    publisher's admin calls. ``verified``: engine -> the version its checksum proved last;
    ``mismatches``: proofs that found other weights than the label names."""

    def __init__(self, post, get):
        self.post, self.get = post, get
        self.verified: dict[str, int] = {}
        self.mismatches = 0
        self.expected: dict[tuple[int, str], dict[str, str]] = {}  # (version, dtype) -> per-tensor hashes
        self.dtypes: dict[str, str] = {}  # engine -> the dtype it holds its weights in

    async def prove(self, url: str, version: int, path: Path) -> bool:
        """Whether ``url`` holds ``version`` (the checksum its ``/weights_checker`` answers is the
        version's). One that does not is named, counted, and relabelled ``UNTRUSTED`` at
        once, with its requests aborted: nothing it samples passes under a version's label."""
        try:
            dtype = await self._dtype(url, path)
            if (version, dtype) not in self.expected:
                tensors = await asyncio.to_thread(load_tensors, path)
                self.expected = {(version, dtype): checksums(tensors, getattr(torch, dtype))}
            status, reply = await self.post(url, "/weights_checker", {"action": "checksum"})
            if status != 200 or not isinstance(reply, dict):
                raise WeightProofError(f"/weights_checker answered HTTP {status}: {str(reply)[:200]}")
            wrong = differing(self.expected[(version, dtype)], reply)
        except (TimeoutError, aiohttp.ClientError, ValueError, OSError, WeightProofError) as exc:
            self.verified.pop(url, None)  # unproved, not disproved: not counted as verified
            log.warning("engine %s: weights version %d not proved: %s: %s", url, version, type(exc).__name__, exc)
            return True
        if not wrong:
            self.verified[url] = version
            return True
        self.verified.pop(url, None)
        self.mismatches += 1
        log.error(
            "engine %s does not hold weights version %d, the version its label names: %d tensors differ (%s); "
            "relabelled %r",
            url,
            version,
            len(wrong),
            ", ".join(wrong[:4]),
            UNTRUSTED,
        )
        try:
            await self.post(url, "/update_weight_version", {"new_version": UNTRUSTED, "abort_all_requests": True})
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.error("engine %s could not be relabelled %r: %s", url, UNTRUSTED, exc)
        return False

    async def _dtype(self, url: str, path: Path) -> str:
        """The dtype ``url`` holds its weights in: its ``--dtype``, or for ``auto`` the model's."""
        if url not in self.dtypes:
            info = await self.get(url, "/server_info")
            dtype = info.get("dtype", "auto") if isinstance(info, dict) else "auto"
            if dtype == "auto":
                config = orjson.loads((path / "config.json").read_bytes())
                dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
            self.dtypes[url] = {"half": "float16", "float": "float32"}.get(dtype, dtype)
        return self.dtypes[url]
