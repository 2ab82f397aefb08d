"""Writes `tasks.parquet` beside this file: the example task's rows.

One row per sum a + b with a, b in 0..9 (100 rows), as TRL and verl users keep a task: a
chat prompt (a system and a user message), the reference `answer` and an extra column
(`level`: "easy" below 10, else "hard") that reaches every reward function by name.

    python make_tasks.py
"""

import os

import pyarrow as pa
import pyarrow.parquet as pq


def rows():
    return [{"prompt": [{"role": "system", "content": "Answer with a number."},
                        {"role": "user", "content": f"What is {a} + {b}?"}],
             "answer": str(a + b), "level": "easy" if a + b < 10 else "hard"}
            for a in range(10) for b in range(10)]


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks.parquet")
    pq.write_table(pa.Table.from_pylist(rows()), path)
    print(f"{path}: {len(rows())} rows")
