"""Definitions more than one test module needs (a test module never imports another), moved out of
test_wheel_contents.py; used by tests/slow/trainer/test_wheel.py, tests/unit/trainer/test_wheel_contents.py."""

from __future__ import annotations

WHEEL_BENCH = {"__init__", "train", "regress", "device", "planner", "memory", "logprobs", "job", "lengths", "stats", "peers"}
