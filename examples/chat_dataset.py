"""Writes examples/chat_capitals.parquet: chat rows (a system prompt, several turns) as a `datasets`
table, then `centerline up --dataset examples/chat_capitals.parquet` (docs/extending.md, "Datasets")."""

from pathlib import Path

import datasets

SYSTEM = {"role": "system", "content": "Answer with the city's name only."}
rows = [
    {"messages": [SYSTEM, {"role": "user", "content": "Capital of France?"}], "answer": "Paris", "split": "train"},
    {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "And of Italy?"},
        ],
        "answer": "Rome",
        "split": "train",
    },
    {"messages": [SYSTEM, {"role": "user", "content": "Capital of Germany?"}], "answer": "Berlin", "split": "heldout"},
]
out = Path(__file__).with_name("chat_capitals.parquet")
datasets.Dataset.from_list(rows).to_parquet(str(out))
print(f"wrote {out}: {len(rows)} rows")
