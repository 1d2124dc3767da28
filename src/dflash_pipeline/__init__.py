"""Offline DFlash drafter training: prepare, tokenize, extract, merge, train, evaluate."""

__version__ = "0.1.0"
