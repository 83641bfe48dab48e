"""The renderers of the trainer's benches: the loss (``bench loss``), a step's memory (``bench step``),
a weight version's trip to the engines (``bench weights``)."""

from __future__ import annotations

from scripts.bench_docs.markdown import mb, sig, table


def loss(fig: dict) -> list[str]:
    header = ["N x V, K", "mode", "REINFORCE", "score centering", "peak: REINFORCE / score centering (extra)"]
    row = [
        f"{fig['tokens']:,} x {fig['vocab']:,}, {fig['k']}",
        f"{fig['mode']}, IS {fig['is_mode']}",
        f"{sig(fig['reinforce_ms'])} ms",
        f"{sig(fig['sc_ms'])} ms ({sig(fig['time_ratio'])}x)",
        f"{sig(fig['reinforce_peak_mb'])} / {sig(fig['sc_peak_mb'])} MiB ({sig(fig['extra_peak_mb'])} MiB)",
    ]
    lines = table(header, [row])
    if "autograd_reinforce_ms" in fig:
        lines += [
            "",
            f"The logits are {sig(fig['logits_mb'])} MiB; REINFORCE the obvious autograd way takes "
            f"{sig(fig['autograd_reinforce_ms'])} ms and peaks at {sig(fig['autograd_reinforce_peak_mb'])} MiB "
            f"({fig['threads']} torch threads).",
        ]
    return lines


def step(fig: dict) -> list[str]:
    """``bench step``: peak memory of one training step per case, dense (f6a6570) and chunked."""
    header = [
        "tokens",
        "path",
        "dtype",
        "step peak",
        "forward+backward peak",
        "floor",
        "checkpointed activations",
        "forward+backward above floor",
        "step",
    ]
    rows = []
    for c in fig["cases"]:
        what = [f"{c['tokens']:,}", "dense logits (f6a6570)" if c["path"] == "dense" else "chunked head", c["dtype"]]
        if not c["run"]:
            rows.append([*what, f"not run: estimated {c['estimate_mb'] / 1024:.1f} GiB", "", "", "", "", ""])
            continue
        rows.append(
            [
                *what,
                f"{c['peak_mb'] / 1024:.2f} GiB",
                f"{c['backward_peak_mb'] / 1024:.2f} GiB",
                f"{c['floor_mb'] / 1024:.2f} GiB",
                f"{sig(c['checkpointed_mb'])} MiB",
                f"{sig(c['above_floor_mb'])} MiB",
                f"{sig(c['step_s'])} s",
            ]
        )
    return [
        f"{fig['layers']} decoder layers of hidden {fig['hidden']:,} (MLP {fig['intermediate']:,}), vocabulary "
        f"{fig['vocab']:,}, tied embeddings; one session of a {fig['prompt']}-token prompt and trained response "
        f"tokens, K = {fig['k']}; one LM-head chunk ({fig['chunk']:,} tokens) is {sig(fig['chunk_mb'])} MiB; "
        f"a case is run when its estimate is below {fig['max_gib']:g} GiB and the memory available.",
        "",
        *table(header, rows),
    ]


def weights(fig: dict) -> list[str]:
    limit = fig["limit_s"]
    header = ["transport", "seconds a version, every engine (median)", "x limit", "proof s (every engine)"]
    rows = [
        [f"`{name}`", sig(t["seconds"]), f"{t['seconds'] / limit:,.1f}x", sig(t["prove_s"])]
        for name, t in fig["transports"].items()
    ]
    return [
        f"{fig['model']}, {mb(fig['version_bytes'])} a version, {fig['engines']} engines, {fig['versions']} versions "
        f"per transport, buckets of {fig['bucket_mb']} MiB; the limit, {sig(limit)} s: the version at this machine's "
        f"memcpy ({sig(fig['memcpy_gbps'])} GB/s) and once per engine over loopback TCP "
        f"({sig(fig['loopback_gbps'])} GB/s), measured in the same run.",
        "",
        *table(header, rows),
    ]
