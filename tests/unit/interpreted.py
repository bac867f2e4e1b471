"""The driver the Triton-interpreter case scripts share (triton_kernel_cases.py, triton_backend_cases.py):
runs the named case_* functions (all without names), prints each recorded result as a JSON line, and
exits non-zero when any is over its tolerance."""

from __future__ import annotations

import json


def run_cases(namespace: dict, results: list[dict], names: list[str]) -> int:
    cases = {name[5:]: fn for name, fn in namespace.items() if name.startswith("case_")}
    for name in names or list(cases):
        cases[name]()
    failed = False
    for result in results:
        result["ok"] = result["max_err"] <= result["tol"]
        failed |= not result["ok"]
        print(json.dumps(result))
    return 1 if failed else 0
