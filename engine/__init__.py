"""The embedded engine: a small HF causal LM served on the CPU with SGLang's HTTP protocol.

model_init (the default byte-level model) -> tokenizer; server (HTTP) -> protocol / chat
(request validation, response shapes) -> scheduler (continuous-batching thread) -> batch
(shared left-padded KV cache) and sampling (SGLang's filter and log-prob semantics);
bench (`centerline bench engine`).
"""
