"""One segment: write it, read its rows, check it, and its write-time statistics."""
