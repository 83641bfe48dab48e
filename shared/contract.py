"""The completeness contract (docs/design.md section 5): what a candidate batch must be to be trained on.

Run by the worker before publishing, by the proxy on every response and by the trainer
before a batch can reach a step. The first defect found raises ``ContractViolation``; the
batch is then rejected whole. Nothing is padded or repaired.

Every check is a numpy expression over whole ``[N]`` / ``[N, K]`` arrays (no Python loop
over tokens or candidates), so the contract is cheap enough to run always.
"""

from __future__ import annotations

from collections.abc import Container

import numpy as np

from shared.msgpack_arrays import DTYPES
from shared.wire import ARRAY_FIELDS, MODES, Batch

# Probability-mass tolerance of the contract (docs/design.md section 5). Log-probs may exceed 0 by
# the same amount: log_softmax in float32 can round a near-certain token to a tiny positive.
MASS_TOL = 1e-5
LOGPROB_TOL = 1e-5

RULES = {
    "shape": "shapes, dtypes, offsets or header fields disagree with wire format v2",
    "empty_prompt": "a sample's prompt has no token, so no position predicts its first response token",
    "empty_response": "a sample has no response token: nothing to train, and no logits for the forward to keep",
    "bad_prompt_token": "a prompt token id is outside [0, vocab)",
    "bad_token": "a sampled token id is outside [0, vocab)",
    "bad_candidate": "a candidate id is outside [-1, vocab)",
    "padding": "an empty slot (id -1) carries a log-prob other than -inf",
    "non_finite": "a log-prob, reward or advantage is NaN or infinite",
    "positive_logprob": "a log-prob is above 0",
    "short_row": "a trained row holds fewer candidates than the contract requires",
    "row_on_untrained_token": "an untrained token (loss_mask 0) carries candidates; its row must be empty",
    "duplicate_candidate": "a row lists the same candidate id twice",
    "row_mass": "a row's candidate probabilities sum to more than 1",
    "support_mass": "a support-mode row's probabilities do not sum to 1",
    "sampled_not_in_support": "a support-mode row does not contain the sampled token",
    "sampled_mismatch": "the sampled token's candidate log-prob differs from sampled_logprobs",
    "token_version": "a token's weight version is negative or newer than the batch's weight_version",
    "unknown_version": "weight_version is not a version the trainer has published",
    "stale": "the oldest trained token is more than max_staleness versions old",
    "duplicate_batch": "batch_id was already trained on",
}


class ContractViolation(ValueError):
    """A batch or response that breaks the contract.

    ``rule`` is a stable short name (a key of ``RULES``); ``sample`` and ``row`` locate the
    defect (sample index in the batch, token position within that sample's response, or within
    its prompt for ``bad_prompt_token``);
    ``expected`` and ``found`` are the values compared, where there are any.
    """

    def __init__(self, rule: str, message: str, *, sample=None, row=None, expected=None, found=None):
        super().__init__(message)
        self.rule, self.sample, self.row, self.expected, self.found = rule, sample, row, expected, found

    def to_dict(self) -> dict:
        return {
            "rule": self.rule,
            "message": str(self),
            "sample": self.sample,
            "row": self.row,
            "expected": self.expected,
            "found": self.found,
        }


def k_above_vocab(k: int, vocab_size: int, mode: str = "selected") -> str | None:
    """Why asking SGLang for ``k`` candidates per token is refused, or None when it may be asked.

    SGLang 0.5.23 takes its whole server down on a ``top_logprobs_num`` above the vocabulary
    (docs/sglang.md), so the worker, the trainer, the probe and the proxy refuse such a K before
    anything is sent. Support mode asks for no top-K, so any K fits there.
    """
    if mode != "selected" or k <= vocab_size:
        return None
    return (
        f"K={k} is above the model's vocabulary of {vocab_size}: SGLang takes its server down on a "
        f"top_logprobs_num above the vocabulary, so nothing is sent; lower K to at most {vocab_size}"
    )


def check_batch(
    batch: Batch,
    *,
    vocab_size: int,
    current_version: int | None = None,
    max_staleness: int | None = None,
    seen: Container[str] | None = None,
) -> None:
    """Raise ``ContractViolation`` for the first defect of ``batch``; return None if it may be trained on.

    ``current_version`` and ``max_staleness`` enable rule 7, ``seen`` (trained batch ids)
    rule 8; the worker and the proxy leave them out.
    """
    check_shapes(batch)
    check_model_inputs(batch, vocab_size)
    if seen is not None and batch.batch_id in seen:
        raise ContractViolation(
            "duplicate_batch",
            f"batch {batch.batch_id!r} was already trained on; a redelivery is dropped",
            found=batch.batch_id,
        )
    if current_version is not None:
        _check_known(batch.weight_version, current_version)
    check_token_versions(batch)
    if current_version is not None and max_staleness is not None:
        _check_stale(oldest_trained_version(batch), current_version, max_staleness)
    for name in ("rewards", "advantages"):
        bad = np.flatnonzero(~np.isfinite(getattr(batch, name)))
        if bad.size:
            i = int(bad[0])
            raise ContractViolation(
                "non_finite",
                f"{name}[{i}] of sample {batch.sample_ids[i]!r} is {getattr(batch, name)[i]}; expected a finite value "
                f"(a reward function returned NaN/inf, or a group's std normalisation divided by zero)",
                sample=i,
                found=float(getattr(batch, name)[i]),
            )
    check_rows(
        batch.response_ids,
        batch.sampled_logprobs,
        batch.loss_mask.astype(bool, copy=False),
        batch.cand_ids,
        batch.cand_logprobs,
        mode=batch.mode,
        k=batch.k,
        vocab_size=vocab_size,
        offsets=batch.offsets,
    )


def check_shapes(batch: Batch) -> None:
    """Rule 1: dtypes, shapes and header fields agree with section 4, offsets are monotone and end at N."""

    def fail(message: str):
        raise ContractViolation("shape", f"batch {batch.batch_id!r}: {message}")

    for name, dtype in ARRAY_FIELDS.items():
        arr = getattr(batch, name)
        if not isinstance(arr, np.ndarray) or arr.dtype != DTYPES[dtype]:
            fail(f"{name} must be a {dtype} array, found {getattr(arr, 'dtype', type(arr).__name__)}")
    if batch.mode not in MODES:
        fail(f"mode is {batch.mode!r}, expected one of {MODES}")
    if batch.k <= 0:
        fail(f"k is {batch.k}, expected a positive candidate width")
    if batch.attempt < 1 or batch.parts < 1:
        fail(f"attempt is {batch.attempt} and parts {batch.parts}, expected both at least 1")
    b, n = len(batch.sample_ids), batch.response_ids.shape[0] if batch.response_ids.ndim == 1 else -1
    if b == 0:
        fail("the batch holds no samples")
    if len(batch.group_ids) != b:
        fail(f"{len(batch.group_ids)} group_ids for {b} sample_ids")
    if len(batch.finish_reasons) not in (0, b):
        fail(f"{len(batch.finish_reasons)} finish_reasons for {b} sample_ids (one per sample, or none)")
    expected = {
        "rewards": (b,),
        "advantages": (b,),
        "offsets": (b + 1,),
        "prompt_offsets": (b + 1,),
        "response_ids": (n,),
        "sampled_logprobs": (n,),
        "loss_mask": (n,),
        "token_versions": (n,),
        "cand_ids": (n, batch.k),
        "cand_logprobs": (n, batch.k),
    }
    for name, shape in expected.items():
        if getattr(batch, name).shape != shape:
            fail(
                f"{name} has shape {list(getattr(batch, name).shape)}, expected {list(shape)} (B={b}, N={n}, "
                f"K={batch.k})"
            )
    if batch.prompt_ids.ndim != 1:
        fail(f"prompt_ids has shape {list(batch.prompt_ids.shape)}, expected one dimension")
    for name, total in (("offsets", n), ("prompt_offsets", batch.prompt_ids.shape[0])):
        offsets = getattr(batch, name)
        if offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 0):
            fail(f"{name} must rise monotonically from 0 to {total}, found {offsets[:8].tolist()}...{offsets[-1]}")
    if np.any(batch.loss_mask > 1):
        fail("loss_mask holds values other than 0 and 1")


def check_model_inputs(batch: Batch, vocab_size: int) -> None:
    """Rules ``empty_prompt``, ``empty_response`` and ``bad_prompt_token``: what the trainer's forward
    feeds the model besides the rows (docs/design.md section 5). Each sample needs a prompt token
    to predict its first response token from and a response token to train; every prompt id
    indexes the embedding. Checked after ``check_shapes``, so both offsets are monotone."""
    for rule, offsets, what, fix in (
        (
            "empty_prompt",
            batch.prompt_offsets,
            "an empty prompt: no position predicts its first response token",
            "a task's prompt must render to at least one token; check the worker's tokenizer and chat template",
        ),
        (
            "empty_response",
            batch.offsets,
            "no response token: nothing to train, and a micro-batch of such samples has no logits",
            "a sample holds at least the one token SGLang sampled; sample the group again rather than pack it",
        ),
    ):
        empty = np.diff(offsets) == 0
        if empty.any():
            i = int(np.argmax(empty))
            raise ContractViolation(
                rule,
                f"sample {i} ({batch.sample_ids[i]!r}) has {what} ({rule}); {fix}",
                sample=i,
                expected=1,
                found=0,
            )
    bad = (batch.prompt_ids < 0) | (batch.prompt_ids >= vocab_size)
    if bad.any():
        i = int(np.argmax(bad))
        sample = int(np.searchsorted(batch.prompt_offsets, i, side="right") - 1)
        row, found = i - int(batch.prompt_offsets[sample]), int(batch.prompt_ids[i])
        raise ContractViolation(
            "bad_prompt_token",
            f"sample {sample} ({batch.sample_ids[sample]!r}) prompt position {row} has token id {found}, outside "
            f"[0, {vocab_size}) (bad_prompt_token): it was tokenized for another vocabulary than the trainer's "
            "model; run workers and trainer with the same model and tokenizer",
            sample=sample,
            row=row,
            found=found,
        )


def check_token_versions(batch: Batch) -> None:
    """Rule ``token_version``: every token was sampled by a version in ``[0, weight_version]``."""
    bad = (batch.token_versions < 0) | (batch.token_versions > batch.weight_version)
    if bad.any():
        where = _Locator(batch.offsets)
        i = where.first(bad)
        found = int(batch.token_versions[i])
        raise where.violation(
            "token_version",
            i,
            f"was sampled by weight version {found}, outside [0, {batch.weight_version}]: the batch's weight_version "
            "must be the newest version that sampled any of its tokens",
            expected=batch.weight_version,
            found=found,
        )


def oldest_trained_version(batch: Batch) -> int:
    """The weight version that staleness is judged on: the oldest among the trained tokens'
    (``weight_version`` for a batch that trains none)."""
    trained = batch.token_versions[batch.loss_mask.astype(bool, copy=False)]
    return int(trained.min()) if trained.size else batch.weight_version


def sample_turns(batch: Batch) -> list[int]:
    """Each sample's turns: its runs of sampled tokens (loss mask 1), 1 for a plain response, a
    session's turns otherwise (every later turn follows the template's untrained tokens)."""
    mask = np.asarray(batch.loss_mask, dtype=np.int8)
    offsets = np.asarray(batch.offsets, dtype=np.int64)
    before = np.concatenate([[0], mask[:-1]]).astype(np.int8)
    before[offsets[:-1][offsets[:-1] < mask.size]] = 0  # a sample's first token begins a run
    starts = np.flatnonzero((mask == 1) & (before == 0))
    return np.diff(np.searchsorted(starts, offsets)).tolist()


def _check_known(version: int, current: int) -> None:
    """Rule ``unknown_version`` on the batch's ``weight_version``, its newest token's."""
    if version < 0 or version > current:
        raise ContractViolation(
            "unknown_version",
            f"weight_version {version} is not a published version (trainer is at {current}); "
            f"the engine reports a version the trainer never sent, check --engine-urls",
            expected=current,
            found=version,
        )


def _check_stale(oldest: int, current: int, max_staleness: int) -> None:
    """Rule ``stale`` on the oldest trained token's version."""
    if current - oldest > max_staleness:
        raise ContractViolation(
            "stale",
            f"batch's oldest trained token, sampled by weights {oldest}, is {current - oldest} versions old, above "
            f"--max-staleness {max_staleness}; lower --max-inflight-steps or raise --max-staleness",
            expected=max_staleness,
            found=current - oldest,
        )


def check_rows(
    response_ids: np.ndarray,
    sampled_logprobs: np.ndarray,
    loss_mask: np.ndarray,
    cand_ids: np.ndarray,
    cand_logprobs: np.ndarray,
    *,
    mode: str,
    k: int,
    vocab_size: int,
    offsets: np.ndarray | None = None,
) -> None:
    """Rules 2-5 on the per-token arrays (``[N]``, ``[N, K]``; ``loss_mask`` bool).

    ``offsets`` ([B+1]) only serves to report sample and row; without it ``row`` is the
    global token index. Used by ``check_batch`` and, on parsed responses, by the proxy.
    """
    where = _Locator(offsets)
    bad = (response_ids < 0) | (response_ids >= vocab_size)
    if bad.any():
        i = where.first(bad)
        raise where.violation(
            "bad_token",
            i,
            f"sampled token id {int(response_ids[i])} is outside [0, {vocab_size})",
            found=int(response_ids[i]),
        )

    empty = cand_ids == -1
    bad = ((cand_ids < -1) | (cand_ids >= vocab_size)).any(axis=1)
    if bad.any():
        i = where.first(bad)
        col = int(np.flatnonzero((cand_ids[i] < -1) | (cand_ids[i] >= vocab_size))[0])
        raise where.violation(
            "bad_candidate",
            i,
            f"candidate {col} has id {int(cand_ids[i, col])}, outside [-1, {vocab_size})",
            found=int(cand_ids[i, col]),
        )

    finite = np.isfinite(cand_logprobs)
    bad = (empty & (cand_logprobs != -np.inf)).any(axis=1)
    if bad.any():
        i = where.first(bad)
        raise where.violation("padding", i, "an empty slot (id -1) carries a log-prob other than -inf")
    bad = (~empty & ~finite).any(axis=1) | ~np.isfinite(sampled_logprobs)
    if bad.any():
        i = where.first(bad)
        raise where.violation(
            "non_finite",
            i,
            f"a log-prob is not finite (sampled {float(sampled_logprobs[i])}, candidates "
            f"{cand_logprobs[i][~empty[i] & ~finite[i]][:4].tolist()}); the sampler or a router produced NaN/inf",
        )
    bad = (cand_logprobs > LOGPROB_TOL).any(axis=1) | (sampled_logprobs > LOGPROB_TOL)
    if bad.any():
        i = where.first(bad)
        found = float(max(cand_logprobs[i].max(), sampled_logprobs[i]))
        raise where.violation(
            "positive_logprob", i, f"log-prob {found} is above 0: these are not log-probabilities", found=found
        )

    counts = k - empty.sum(axis=1)
    if mode == "selected":
        need = min(k, vocab_size)
        bad = loss_mask & (counts != need)
        if bad.any():
            i = where.first(bad)
            raise where.violation(
                "short_row",
                i,
                f"has {int(counts[i])} candidates, expected {need}" + _short_row_cause(int(counts[i]), need),
                expected=need,
                found=int(counts[i]),
            )
    bad = ~loss_mask & (counts > 0)
    if bad.any():
        i = where.first(bad)
        raise where.violation(
            "row_on_untrained_token",
            i,
            f"is not trained (loss_mask 0) yet holds {int(counts[i])} candidates; a token SGLang did not sample (a "
            "prompt or template token of a session) carries an empty row",
            expected=0,
            found=int(counts[i]),
        )

    ordered = np.sort(cand_ids, axis=1)
    bad = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(axis=1)
    if bad.any():
        i = where.first(bad)
        dup = ordered[i, 1:][(ordered[i, 1:] == ordered[i, :-1]) & (ordered[i, 1:] >= 0)][0]
        raise where.violation(
            "duplicate_candidate", i, f"candidate id {int(dup)} appears more than once", found=int(dup)
        )

    mass = np.exp(cand_logprobs).sum(axis=1)
    bad = mass > 1 + MASS_TOL
    if bad.any():
        i = where.first(bad)
        raise where.violation(
            "row_mass",
            i,
            f"candidate probabilities sum to {float(mass[i]):.7f}, above 1 + {MASS_TOL}",
            expected=1.0,
            found=float(mass[i]),
        )

    match = cand_ids == response_ids[:, None]
    in_row = match.any(axis=1)
    if mode == "support":
        bad = loss_mask & (np.abs(mass - 1) > MASS_TOL)
        if bad.any():
            i = where.first(bad)
            raise where.violation(
                "support_mass",
                i,
                f"support probabilities sum to {float(mass[i]):.7f}, expected 1 within {MASS_TOL}"
                + (
                    " (empty support: the router probably dropped sampling_logprobs_mode/return_sampling_mask; run "
                    "`centerline probe`)"
                    if counts[i] == 0
                    else ""
                ),
                expected=1.0,
                found=float(mass[i]),
            )
        bad = loss_mask & ~in_row
        if bad.any():
            i = where.first(bad)
            raise where.violation(
                "sampled_not_in_support",
                i,
                f"sampled token {int(response_ids[i])} is not in the recorded support",
                found=int(response_ids[i]),
            )

    sampled_cand = np.where(match, cand_logprobs, 0).sum(axis=1)
    bad = in_row & (np.abs(sampled_cand - sampled_logprobs) > MASS_TOL)
    if bad.any():
        i = where.first(bad)
        raise where.violation(
            "sampled_mismatch",
            i,
            f"sampled token {int(response_ids[i])} has candidate log-prob {float(sampled_cand[i]):.7f} but sampled "
            "log-prob "
            f"{float(sampled_logprobs[i]):.7f}; the two come from different distributions (temperature or filter "
            "applied to one only)",
            expected=float(sampled_logprobs[i]),
            found=float(sampled_cand[i]),
        )


def _short_row_cause(found: int, need: int) -> str:
    if found == 0:
        return (
            ": the upstream returned no top-logprobs; the router probably dropped top_logprobs_num/return_logprob. "
            "Run `centerline probe`"
        )
    if found == 20 and need > 20:
        return f": the router probably caps top_logprobs at 20; run `centerline probe --k {need}`"
    return ": the upstream or a router truncated the candidate list; run `centerline probe`"


class _Locator:
    """Turns a global token index into (sample, row) for error reports."""

    def __init__(self, offsets: np.ndarray | None):
        self.offsets = offsets

    @staticmethod
    def first(mask: np.ndarray) -> int:
        return int(np.argmax(mask))

    def violation(self, rule: str, i: int, what: str, **values) -> ContractViolation:
        if self.offsets is None:
            return ContractViolation(rule, f"row {i} {what}", row=i, **values)
        sample = int(np.searchsorted(self.offsets, i, side="right") - 1)
        row = i - int(self.offsets[sample])
        return ContractViolation(rule, f"sample {sample} row {row} {what}", sample=sample, row=row, **values)
