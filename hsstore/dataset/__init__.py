"""The dataset: create, open, write, samples and their checks, verify and repair."""
