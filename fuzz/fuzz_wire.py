"""Fuzz the trainer's intake: ``decode_batch`` then ``check_batch`` on hostile bytes.

The only acceptable failures are ``WireError`` (not a v2 batch) and ``ContractViolation``
(a batch that may not be trained on); anything else, a hang (libFuzzer ``-timeout``) or a
memory blow-up (``-rss_limit_mb``) is a finding. Seeds are valid batches from
``centerline/synth.py`` (both modes, a few shapes), written to ``fuzz/corpus/wire/`` when that
directory (or the first one given) is empty; libFuzzer adds what it finds there.

    .venv/bin/python -m fuzz.fuzz_wire -max_total_time=600 -rss_limit_mb=1024 -timeout=5

Any libFuzzer flag works (``-runs=N``, ``-jobs=N``, a corpus directory of your own).
``TestOneInput`` is importable without atheris: ``tests/fuzz/test_harnesses.py`` drives it
with hypothesis bytes too.
"""

from __future__ import annotations

import sys
from pathlib import Path

from centerline.synth import make_batch
from shared.contract import ContractViolation, check_batch
from shared.msgpack_arrays import WireError
from shared.wire import decode_batch, encode_batch

VOCAB = 64
CORPUS = Path(__file__).resolve().parent / "corpus" / "wire"


def seeds() -> list[bytes]:
    """Valid messages: what a producer sends, so mutations start deep inside the format."""
    shapes = [(1, 0, 1), (1, 1, 1), (2, 3, 4), (3, 2, 8), (1, 4, 64), (2, 2, 128)]
    out = [
        encode_batch(make_batch(samples=b, tokens_per_sample=t, k=k, vocab_size=VOCAB, seed=i))
        for i, (b, t, k) in enumerate(shapes)
    ]
    out += [
        encode_batch(
            make_batch(samples=b, tokens_per_sample=t, k=k, vocab_size=VOCAB, mode="support", top_k=max(1, k // 2))
        )
        for b, t, k in shapes[1:4]
    ]
    return out


def TestOneInput(data: bytes) -> None:
    try:
        check_batch(decode_batch(data), vocab_size=VOCAB)
    except (WireError, ContractViolation):
        pass


def write_corpus(directory: Path, messages: list[bytes]) -> Path:
    """``messages`` as files ``seed-N`` in ``directory``, unless it already holds a corpus."""
    directory.mkdir(parents=True, exist_ok=True)
    if not any(directory.iterdir()):
        for i, message in enumerate(messages):
            (directory / f"seed-{i}").write_bytes(message)
    return directory


def fuzz(argv: list[str], test, corpus: Path, messages: list[bytes], modules: tuple[str, ...], mutator=None) -> None:
    """Run libFuzzer on ``test``, with coverage of the functions of ``modules``, on the corpus
    directories ``argv`` names (default ``corpus``); the first is seeded with ``messages`` when empty.
    ``mutator``: libFuzzer's custom mutator, ``(data, max_size, seed) -> bytes``."""
    import gc
    import types

    import atheris

    # Only the code under test: atheris.instrument_all() would instrument numpy, msgpack, ... too (slow).
    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType) and obj.__module__ in modules:
            atheris.instrument_func(obj)
    directories = [arg for arg in argv[1:] if not arg.startswith("-")]
    if not directories:
        argv, directories = [*argv, str(corpus)], [str(corpus)]
    write_corpus(Path(directories[0]), messages)
    if not any(arg.startswith("-artifact_prefix=") for arg in argv):
        argv.append(f"-artifact_prefix={corpus.parent}/{corpus.name}-")  # crash-*, timeout-*, oom-* beside the corpus
    atheris.Setup(argv, test, **({"custom_mutator": mutator} if mutator else {}))
    atheris.Fuzz()


if __name__ == "__main__":
    fuzz(sys.argv, TestOneInput, CORPUS, seeds(), ("shared.wire", "shared.msgpack_arrays", "shared.contract"))
