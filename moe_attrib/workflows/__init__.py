"""Whole jobs as one Python call each: build, fit and score from files (what the command line runs),
scoring every checkpoint of a run, attribution during a `transformers.Trainer` run; and what they
share: loading models and tokenizers, checks before any work, memory plans."""
