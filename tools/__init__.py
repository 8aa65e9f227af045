"""Developer tools: the tiny test model and scripts meant to be run by hand (GPU checks)."""
