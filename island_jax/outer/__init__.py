"""The outer loop's math: codec, weighted merge and outer optimizer, as pure functions."""
