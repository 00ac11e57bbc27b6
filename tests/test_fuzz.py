"""Fuzzing the public API with seeded broken arguments in a subprocess (see tests/fuzz_calls.py): no crash, no
hang, and every error a ValueError or TypeError naming the argument that was broken."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_worker(seed: int, count: int) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz_calls", str(seed), str(count)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    started = [r for r in records if "start" in r]
    assert proc.returncode == 0, (f"the fuzz worker died (exit {proc.returncode}) in call "
                                  f"{started[-1] if started else None}:\n{proc.stderr[-3000:]}")
    return [r for r in records if "start" not in r]


def names_argument(message: str, names) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", message) for n in names)


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzzed_calls_fail_cleanly_or_run(seed):
    records = run_worker(seed, 150)
    calls = [r for r in records if r["kind"] == "call"]
    assert len(calls) == 150
    for r in calls:
        where = f"call {r['index']} ({r['op']}, broken {r['broken']!r}): {r.get('type')}: {r.get('message')}"
        if r["outcome"] == "ok":
            assert not r["must_fail"], f"accepted a bad argument: {where}"
            continue
        assert r["broken"], f"a valid call failed: {where}"
        assert r["type"] in ("ValueError", "TypeError"), where
        assert names_argument(r["message"], r["names"]), f"the error does not name {r['names']}: {where}"
    assert sum(r["outcome"] == "error" for r in calls) > 50  # the fuzzer does break things

    configs = [r for r in records if r["kind"] == "config"]
    assert configs
    for r in configs:
        if r["outcome"] == "error":
            where = f"{r['cls']}({r['field']}={r['value']}): {r['type']}: {r['message']}"
            assert r["type"] in ("ValueError", "TypeError") and r["field"] in r["message"], where
