"""fxbackend.patterns: filled in by the pattern and kernel issues."""
