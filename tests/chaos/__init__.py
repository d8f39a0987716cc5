"""Adversarial suites: a randomized kill matrix and a protocol fuzzer (docs/testing.md)."""
