"""Import-only stand-in for `sgl_kernel` on machines without a GPU (docs/sglang.md).

The package index has no CPU build of `sgl_kernel`, yet sglang 0.5.23 with
`SGLANG_USE_CPU_ENGINE=1` imports these nine `*_cpu` names at module load. None of them is
called on the plain serving path (no speculative decoding, no HiSparse). Each raises if it
ever is, naming itself, so a code path that needs a real kernel fails loudly instead of
computing something else. `centerline sglang --device cpu` puts its parent directory on the SGLang server's
`PYTHONPATH`, and nothing else does;
never into a GPU image.
"""

NAMES = (
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


def _missing(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is the import-only CPU stand-in "
            "(centerline/sgl_kernel_stub). Run this SGLang feature on a GPU image with the real sgl_kernel."
        )

    kernel.__name__ = name
    return kernel


for _name in NAMES:
    globals()[_name] = _missing(_name)
del _name
