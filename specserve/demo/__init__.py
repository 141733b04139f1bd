"""The embedded default: a small code-completion target/draft pair trained on CPython's stdlib."""
