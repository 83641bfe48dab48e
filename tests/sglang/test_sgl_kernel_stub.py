"""The import-only `sgl_kernel` stand-in (centerline/sgl_kernel_stub): SGLang's CPU path imports
its nine names at module load, and the shared server starts with it; calling any of them fails
loudly, naming itself, instead of computing something else."""

from __future__ import annotations

import importlib.util
import re

import pytest

from centerline.sgl_kernel_stub import sgl_kernel as stub

NINE = (
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
)


def test_the_stub_defines_the_nine_names():
    assert stub.NAMES == NINE
    assert all(callable(getattr(stub, name)) and getattr(stub, name).__name__ == name for name in NINE)


@pytest.mark.parametrize("name", NINE)
def test_calling_a_stub_kernel_raises_not_implemented_naming_it(name):
    with pytest.raises(
        NotImplementedError,
        match=f"^sgl_kernel.{re.escape(name)} is not available: this is the import-only CPU stand-in",
    ):
        getattr(stub, name)(1, key="value")


@pytest.mark.integration
def test_sglang_serves_with_the_stub_as_its_only_sgl_kernel(sglang):
    """No real sgl_kernel is installed here (the index has no CPU build), so the server that
    answers is one that imported the stand-in."""
    assert importlib.util.find_spec("sgl_kernel") is None
    assert sglang.proc.poll() is None
